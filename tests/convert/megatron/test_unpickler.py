"""The allow-list unpickler: crafted payloads in each of Megatron's pickled files are refused
before anything runs, naming the file and the class; what Megatron's files need is admitted;
tensors are read lazily and exactly (views, offsets, dtypes)."""

import argparse
import io
import os
import pickle
import re
import subprocess

import numpy as np
import pytest
import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron.importer import import_megatron
from megatron_p2r.convert.megatron.unpickler import Kind, TorchArchive, UnpicklingRefused, load_pickle
from megatron_p2r.convert.reshard import Target
from tests.convert.megatron.fixtures import (
    GPT,
    LLAMA,
    fixture_globals,
    make_weights,
    megatron_args,
    megatron_enums,
    write_legacy,
    write_torch_dist,
)


class Payload:
    """What an attacker pickles: unpickling it would run ``call(*args)``."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def payloads(marker):
    return [
        Payload(os.system, f"touch {marker}"),
        Payload(subprocess.call, ["touch", str(marker)]),
        Payload(eval, f"open({str(marker)!r}, 'w')"),
    ]


def _legacy(root):
    layout = (1, 2, 1)
    write_legacy(str(root), GPT, make_weights(GPT, 1), megatron_args(GPT, *layout), layout)
    return root / "iter_0000007" / "mp_rank_00_001" / "model_optim_rng.pt"


def _dist(root):
    write_torch_dist(str(root), LLAMA, make_weights(LLAMA, 1), megatron_args(LLAMA, 1, 1, 1), (1, 1, 1))
    return root / "iter_0000007"


def _plant_in_legacy(root, payload):
    path = _legacy(root)
    with (
        megatron_enums() as backend,
        torch.serialization.safe_globals(fixture_globals(backend)),
    ):  # the test's own trusted file (torch.load imports the classes it names)
        state = torch.load(path, weights_only=True)
        state["model"]["decoder.layers.0.self_attention.linear_qkv.weight"] = payload
        torch.save(state, path)
    return path


def _plant_in_common(root, payload):
    path = _dist(root) / "common.pt"
    torch.save({"args": payload}, path)
    return path


def _plant_in_metadata(root, payload):
    path = _dist(root) / ".metadata"
    with open(path, "wb") as fh:
        pickle.dump(payload, fh)
    return path


def _plant_in_chunk(root, payload):
    """Append a torch.save of the payload to a .distcp file and point one chunk at it."""
    iter_dir = _dist(root)
    with open(iter_dir / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == "embedding.word_embeddings.weight")
    blob = io.BytesIO()
    torch.save(payload, blob)
    path = iter_dir / info.relative_path
    with open(path, "ab") as fh:
        start = fh.tell()
        fh.write(blob.getvalue())
    info.offset, info.length = start, len(blob.getvalue())
    with open(iter_dir / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)
    return path


@pytest.mark.parametrize("plant", [_plant_in_legacy, _plant_in_common, _plant_in_metadata, _plant_in_chunk])
def test_crafted_payloads_are_refused_without_running(plant, tmp_path):
    marker = tmp_path / "pwned"
    for n, payload in enumerate(payloads(marker)):
        root = tmp_path / f"src{n}"
        path = plant(root, payload)
        with pytest.raises(UnpicklingRefused) as err:
            import_megatron(str(root), str(tmp_path / f"dst{n}"), Target(), progress=False)
        assert str(path) in str(err.value) and "nothing was executed" in str(err.value)
        # as the pickle names it (protocol 2 writes Python 2 names: commands.call, __builtin__.eval)
        assert re.search(rf"refusing to unpickle \w+\.{payload.call.__name__}: ", str(err.value))
        assert not marker.exists()
        assert not (tmp_path / f"dst{n}").exists() and not (tmp_path / f"dst{n}.tmp").exists()


def test_what_megatron_files_hold_is_admitted_and_tensors_read_exactly(tmp_path):
    base = torch.arange(40, dtype=torch.float32).to(torch.bfloat16)
    with megatron_enums() as backend:
        state = {
            "args": argparse.Namespace(
                num_layers=2, params_dtype=torch.bfloat16, attention_backend=backend.auto, shape=torch.Size([2, 3])
            ),
            "model": {
                "view": base[3:9].view(2, 3),
                "transposed": base[:20].view(4, 5).t(),
                "shared": base,
                "empty": torch.zeros(0, 3),
                "param": torch.nn.Parameter(torch.ones(2)),
                "te._extra_state": io.BytesIO(b"fp8"),
            },
            "rng_state": [{"np_rng_state": np.random.get_state(), "bytes": b"\x00\xff"}],
        }
        torch.save(state, tmp_path / "x.pt")
    obj = TorchArchive(str(tmp_path / "x.pt"), Kind.MEGATRON).obj
    args = obj["args"]
    assert (args.num_layers, args.params_dtype, args.shape) == (2, torch.bfloat16, (2, 3))
    assert args.attention_backend.qualname == "megatron.core.transformer.enums.AttnBackend"
    model = obj["model"]
    for key in ("view", "transposed", "shared", "empty", "param"):
        want = state["model"][key].detach()
        got = model[key].read()
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert model["view"].offset == 3 and model["view"].storage.numel == 40  # one storage, read in part
    assert obj["rng_state"][0]["bytes"] == b"\x00\xff"
    with pytest.raises(UnpicklingRefused, match=r"x.pt: refusing to unpickle argparse.Namespace: a tensor chunk"):
        TorchArchive(str(tmp_path / "x.pt"), Kind.TENSORS)


def test_protocol_2_bytes_helpers_only_as_protocol_2_uses_them(tmp_path):
    """Protocol 2 writes bytes as _codecs.encode(text, 'latin1') and b'' as bytes(); any other
    use is refused (bytes(10**12) would allocate a terabyte)."""
    with open(tmp_path / "b", "wb") as fh:
        fh.write(pickle.dumps(Payload(bytes, 10**12), protocol=2))
    with pytest.raises(CheckpointError, match=r"bytes\(\) is admitted only without arguments"):
        load_pickle(str(tmp_path / "b"), Kind.MEGATRON)
    evil = pickle.dumps(Payload(__import__("_codecs").encode, "x", "utf-8"), protocol=2)
    with open(tmp_path / "p", "wb") as fh:
        fh.write(evil)
    with pytest.raises(CheckpointError, match="only for latin-1"):
        load_pickle(str(tmp_path / "p"), Kind.MEGATRON)
    # DCP metadata admits no _codecs at all
    with open(tmp_path / "q", "wb") as fh:
        fh.write(pickle.dumps(b"abc", protocol=2))
    with pytest.raises(UnpicklingRefused, match="_codecs.encode"):
        load_pickle(str(tmp_path / "q"), Kind.DCP_METADATA)
