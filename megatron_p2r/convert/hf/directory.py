"""The files of a Hugging Face model directory: weights in one safetensors file or in shards with
an index, and JSON files (config.json, tokenizer_config.json)."""

from __future__ import annotations

import json
import os
import re
from typing import List, Optional, Sequence, Tuple

import torch

from megatron_p2r.convert.hf.architecture import HFConversionError
from megatron_p2r.checkpoint.safetensors_io import ReaderCache, nbytes
from megatron_p2r.files import MiB, read_json

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def parse_size(text: str) -> int:
    """'5GB' (10^9), '500MiB' (2^20), or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise HFConversionError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MiB or 1000000")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }[unit]
    if not 1 <= number * scale <= 2**50:
        raise HFConversionError(f"--max-shard-size {text!r}: expected a size between 1 byte and 1 PiB")
    return int(number * scale)


def plan_shards(groups: Sequence[Sequence[Tuple[str, str, tuple]]], limit: int) -> List[List[int]]:
    """Split rule outputs (each a list of (name, dtype, shape), kept together) into files of at
    most ``limit`` bytes (a group larger than the limit gets a file of its own)."""
    files: List[List[int]] = [[]]
    size = 0
    for i, group in enumerate(groups):
        group_bytes = sum(nbytes(d, s) for _, d, s in group)
        if files[-1] and size + group_bytes > limit:
            files.append([])
            size = 0
        files[-1].append(i)
        size += group_bytes
    return files


def weight_file_names(count: int) -> List[str]:
    """transformers' names for ``count`` weight files (one file has no index)."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")


def read_hf_config(path: str) -> dict:
    """config.json of an HF directory (a regular file, bounded, unique keys; its fields: ``config_schema``)."""
    config = os.path.join(path, "config.json")
    try:
        return read_json(config, HFConversionError, limit=16 * MiB)
    except FileNotFoundError:
        raise HFConversionError(f"{path}: no config.json (not a Hugging Face model directory)") from None


def _read_weight_map(index: str) -> dict:
    """The index's weight_map: tensor name -> file name (each opened later only inside the directory)."""
    try:
        data = read_json(index, HFConversionError)
    except OSError as exc:
        raise HFConversionError(f"{index}: cannot read it ({exc.strerror})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFConversionError(f"{index}: expected an object with a 'weight_map' of tensor names to file names")
    return weight_map


class HFDirectory:
    """The safetensors weights of an HF model directory (one file, or shards with an index)."""

    def __init__(self, path: str):
        self.path = path
        self.readers = ReaderCache(path)
        index = os.path.join(path, INDEX_FILE)
        if os.path.lexists(index):
            self.weight_map = _read_weight_map(index)
        elif os.path.lexists(os.path.join(path, SINGLE_FILE)):
            self.weight_map = {n: SINGLE_FILE for n in self.readers(SINGLE_FILE).names()}
        else:
            found = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
            raise HFConversionError(
                f"{path}: no {SINGLE_FILE} or {INDEX_FILE}"
                + (f" (found {found[0]}: only safetensors are read, never pickles)" if found else "")
            )

    def resolve(self, name: str) -> Optional[str]:
        """The stored name of ``name``, also when the file omits the base prefix (original GPT2: ``h.0.``)."""
        if name in self.weight_map:
            return name
        short = name.split(".", 1)[1] if name.startswith(("transformer.", "model.")) else None
        return short if short in self.weight_map else None

    def entry(self, stored: str) -> dict:
        reader = self.readers(self.weight_map[stored])
        if stored not in reader.entries:
            raise HFConversionError(
                f"{self.path}: {INDEX_FILE} puts {stored!r} in {self.weight_map[stored]}, which has no such tensor"
            )
        return reader.entries[stored]

    def read(self, stored: str) -> torch.Tensor:
        return self.readers(self.weight_map[stored]).read(stored)
