"""Bad Megatron checkpoints fail before anything is written, with one message naming the file
and the field (or tensor) and what was expected."""

import collections
import io
import os
import pickle
import re
import shutil
import signal
import zipfile

import pytest
import torch

from megatron_p2r.checkpoint.errors import CheckpointError
from megatron_p2r.convert.megatron.importer import import_megatron
from megatron_p2r.convert.reshard import Target
from tests.convert.megatron.fixtures import (
    GPT,
    MIXTRAL,
    fixture_globals,
    make_weights,
    megatron_args,
    megatron_enums,
    write_legacy,
    write_torch_dist,
)

LEGACY_LAYOUT, DIST_LAYOUT = (2, 2, 1), (2, 1, 2)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    write_legacy(str(root / "legacy"), GPT, make_weights(GPT, 2), megatron_args(GPT, *LEGACY_LAYOUT), LEGACY_LAYOUT)
    write_torch_dist(
        str(root / "dist"), MIXTRAL, make_weights(MIXTRAL, 2), megatron_args(MIXTRAL, *DIST_LAYOUT), DIST_LAYOUT
    )
    return root


@pytest.fixture
def legacy(pristine, tmp_path):
    shutil.copytree(pristine / "legacy", tmp_path / "src")
    return tmp_path / "src"


@pytest.fixture
def dist(pristine, tmp_path):
    shutil.copytree(pristine / "dist", tmp_path / "src")
    return tmp_path / "src"


def fails(src, match):
    dst = os.path.join(os.path.dirname(src), "dst")
    with pytest.raises(CheckpointError, match=match):
        import_megatron(str(src), dst, Target(), progress=False)
    assert not os.path.exists(dst) and not os.path.exists(dst + ".tmp")


def edit_rank_file(path, change):
    """Rewrite one legacy rank file (the test's own trusted file) after ``change(state)``."""
    with megatron_enums() as backend, torch.serialization.safe_globals(fixture_globals(backend)):
        state = torch.load(path, weights_only=True)
        change(state)
        torch.save(state, path)


def test_where_the_checkpoint_is(tmp_path, legacy):
    """SRC, the tracker file and the iteration it names."""
    fails(tmp_path / "nowhere", "no checkpoint at .*nowhere: the directory does not exist")
    os.makedirs(tmp_path / "empty")
    fails(tmp_path / "empty", "empty is not a Megatron-LM checkpoint: it has no latest_checkpointed_iteration.txt")
    tracker = legacy / "latest_checkpointed_iteration.txt"
    tracker.write_text("seven")
    fails(legacy, "latest_checkpointed_iteration.txt: expected an iteration number or 'release', found 'seven'")
    tracker.write_text("8")
    fails(legacy, r"latest_checkpointed_iteration.txt names iter_0000008, but .*iter_0000008 holds no mp_rank_")
    # what Megatron reads: a release directory, or the iteration directory itself
    os.rename(legacy / "iter_0000007", legacy / "release")
    tracker.write_text("release\n")
    import_megatron(str(legacy), str(tmp_path / "a"), Target(), progress=False)
    import_megatron(str(legacy / "release"), str(tmp_path / "b"), Target(), progress=False)


def test_legacy_files(legacy):
    iter_dir = legacy / "iter_0000007"
    last = iter_dir / "mp_rank_01_001" / "model_optim_rng.pt"
    data = last.read_bytes()
    last.write_bytes(data[: len(data) // 2])
    fails(legacy, r"mp_rank_01_001/model_optim_rng.pt: not a zip archive written by torch.save .* or truncated")
    last.unlink()
    fails(legacy, r"missing file .*mp_rank_01_001/model_optim_rng.pt \(each mp_rank directory holds")
    os.makedirs(iter_dir / "mp_rank_02_000")
    fails(legacy, r"mp_rank_02_000: not a rank of the saved layout \(args: TP=2, PP=2, EP=1, so 4 mp_rank")


def test_legacy_contents(legacy):
    first = legacy / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt"
    other = legacy / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt"
    edit_rank_file(first, lambda s: s.update(checkpoint_version=2.0))
    fails(legacy, r"mp_rank_00_000/model_optim_rng.pt: checkpoint_version 2.0; .* before version 3.0")
    edit_rank_file(first, lambda s: s.update(checkpoint_version=3.0, model0=s.pop("model")))
    fails(
        legacy,
        r"mp_rank_00_000/model_optim_rng.pt: no 'model' in the saved dict \(keys .*'model0'.*; "
        r"args.virtual_pipeline_model_parallel_size is not set, so 'model'\)",
    )
    edit_rank_file(
        first,
        lambda s: s.update(
            model=s.pop("model0"), args=megatron_args(GPT, *LEGACY_LAYOUT, virtual_pipeline_model_parallel_size=2)
        ),
    )
    fails(legacy, r"mp_rank_00_000/model_optim_rng.pt: no 'model0' in the saved dict .* so model0..model1\)")
    edit_rank_file(first, lambda s: s.update(args=None))
    fails(legacy, r"mp_rank_00_000/model_optim_rng.pt: 'args' is NoneType, expected Megatron's saved argparse")
    edit_rank_file(first, lambda s: s.update(args=megatron_args(GPT, *LEGACY_LAYOUT, num_layers=None)))
    fails(legacy, r"mp_rank_00_000/model_optim_rng.pt: args.num_layers is missing")
    edit_rank_file(first, lambda s: s.update(args=megatron_args(GPT, *LEGACY_LAYOUT, ffn_hidden_size=32)))
    fails(
        legacy,
        r"mp_rank_00_000/model_optim_rng.pt: decoder.layers.0.mlp.linear_fc1.weight has shape \[64, 32\], "
        r"the saved args imply \[32, 32\]",
    )
    edit_rank_file(
        first,
        lambda s: s.update(args=megatron_args(GPT, *LEGACY_LAYOUT, group_query_attention=True, num_query_groups=2)),
    )
    fails(
        legacy,
        r"decoder.layers.0.self_attention.linear_qkv.weight has shape \[96, 32\], the saved args imply "
        r"\[64, 32\]",
    )
    edit_rank_file(first, lambda s: s.update(args=megatron_args(GPT, *LEGACY_LAYOUT)))
    edit_rank_file(other, lambda s: s["model"].pop("decoder.layers.1.mlp.linear_fc2.weight"))
    fails(legacy, r"decoder.layers.3.mlp.linear_fc2.weight is stored by TP ranks \[0\], expected 0..1")
    edit_rank_file(
        other,
        lambda s: s["model"].update(
            {
                "decoder.layers.1.mlp.linear_fc2.weight": torch.zeros(32, 32),
                "decoder.layers.1.mlp.extra.weight": torch.zeros(2),
            }
        ),
    )
    fails(
        legacy,
        r"mp_rank_01_001/model_optim_rng.pt: 1 tensors have no place in our model, e.g. "
        r"decoder.layers.3.mlp.extra.weight; refusing to drop weights",
    )


def test_torch_dist_files(dist):
    iter_dir = dist / "iter_0000007"
    (iter_dir / "metadata.json").write_text('{"sharded_backend": "zarr"}')
    fails(dist, r"metadata.json: sharded_backend 'zarr'; only torch_dist is read")
    (iter_dir / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    chunk = sorted(iter_dir.glob("*.distcp"))[-1]
    data = chunk.read_bytes()
    chunk.write_bytes(data[:-100])
    fails(dist, rf"{chunk.name}: truncated: {len(data) - 100} bytes, .*\.metadata places a chunk of '.*' up to byte")
    chunk.unlink()
    fails(dist, rf"missing file .*{chunk.name} \(.*\.metadata places chunks of '.*' there\)")
    (iter_dir / ".metadata").write_bytes(b"\x80\x04garbage")
    fails(dist, r"\.metadata: not a readable pickle")
    (iter_dir / "common.pt").unlink()
    fails(dist, r"missing file .*iter_0000007/common.pt")


def test_torch_dist_chunk_contents(dist):
    """A .metadata that misses one TP shard's chunk of a tensor."""
    iter_dir = dist / "iter_0000007"
    with open(iter_dir / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)  # the test's own trusted file
    key, missing = "decoder.layers.self_attention.linear_qkv.weight", (0, 24, 0)  # layer 0, TP rank 1
    entry = metadata.state_dict_metadata[key]
    entry.chunks = [c for c in entry.chunks if tuple(c.offsets) != missing]
    metadata.storage_data = {
        i: s for i, s in metadata.storage_data.items() if not (i.fqn == key and tuple(i.offset) == missing)
    }
    with open(iter_dir / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)
    fails(
        dist,
        r"\.metadata: the chunks of 'decoder.layers.self_attention.linear_qkv.weight' cover 768 elements "
        r"of decoder.layers.0.self_attention.linear_qkv.weight \[48, 32\]",
    )


def _first_tensor_storage(metadata):
    """The first chunk of a tensor (not of a pickled object, which the import skips unless it needs
    it): torch's planner orders storage_data differently from one process to the next."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    return next((i, s) for i, s in metadata.storage_data.items() if i.fqn in tensors)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda m: setattr(_first_tensor_storage(m)[1], "offset", "abc"),
            r"field offset is 'abc', expected an integer >= 0",
        ),
        (lambda m: setattr(_first_tensor_storage(m)[1], "length", -1), r"field length is -1, expected an integer >= 0"),
        (
            lambda m: setattr(_first_tensor_storage(m)[1], "relative_path", 5),
            r"field relative_path is 5, expected a string",
        ),
        (lambda m: setattr(m, "storage_data", [1, 2]), r"field storage_data is \[1, 2\], expected a dict"),
        (
            lambda m: setattr(next(iter(m.state_dict_metadata.values())), "size", ["x"]),
            r"field size is \['x'\], expected a list of at most 8 integers >= 0",
        ),
        (
            lambda m: setattr(next(iter(m.state_dict_metadata.values())), "size", [2] * 9),
            r"field size is \[2, 2, 2, 2, 2, 2, \.\.\.\]",
        ),
        (
            lambda m: setattr(next(iter(m.state_dict_metadata.values())), "chunks", 3),
            r"field chunks is 3, expected a list",
        ),
    ],
)
def test_wrongly_typed_metadata_fields_are_named(dist, edit, match):
    """Issue 38 bug 6: a storage offset "abc" was a ValueError traceback (int("abc"))."""
    iter_dir = dist / "iter_0000007"
    with open(iter_dir / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)  # the test's own trusted file
    edit(metadata)
    with open(iter_dir / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)
    fails(dist, r"\.metadata: " + match)


@pytest.mark.parametrize("name", ["../outside.distcp", "ABSOLUTE"])
def test_torch_dist_chunk_files_stay_in_the_iteration_directory(dist, name):
    """A relative_path in .metadata that leads out of the iteration directory is refused, not read."""
    iter_dir = dist / "iter_0000007"
    with open(iter_dir / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)  # the test's own trusted file
    info = next(s for i, s in metadata.storage_data.items() if i.fqn == "decoder.layers.mlp.router.weight")
    shutil.copy(iter_dir / info.relative_path, dist / "outside.distcp")  # a valid file: only its place is wrong
    info.relative_path = str(dist / "outside.distcp") if name == "ABSOLUTE" else name
    with open(iter_dir / ".metadata", "wb") as fh:
        pickle.dump(metadata, fh)
    fails(
        dist,
        r"relative_path of 'decoder.layers.mlp.router.weight': .*outside.distcp.* (is not a file name "
        r"relative to|resolves to .*, outside)",
    )


# ----------------------------------------------------------------------------- hostile rank files


class _Record:
    """A storage record of a hand-written torch.save zip: its bytes and the element count its
    pickle claims (a forger's number, not necessarily the bytes')."""

    def __init__(self, data: bytes, claimed_numel: int, storage: str = "FloatStorage"):
        self.data, self.claimed_numel, self.storage = data, claimed_numel, storage


class _View:
    """A tensor as torch.save pickles it: a rebuild call over a storage record."""

    def __init__(self, record, offset, shape, stride):
        self.args = (record, offset, tuple(shape), tuple(stride), False, collections.OrderedDict())

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args


class _TorchZipPickler(pickle.Pickler):
    """Pickles as torch.save does (tensors as storage records), but writes whatever views and
    element counts it is given."""

    def __init__(self, fh, records):
        super().__init__(fh, protocol=2)
        self.records = records

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous()
            return _View(
                _Record(t.view(-1).view(torch.uint8).numpy().tobytes(), t.numel(), _STORAGE[t.dtype]),
                0,
                t.shape,
                t.stride(),
            ).__reduce__()
        return NotImplemented

    def persistent_id(self, obj):
        if isinstance(obj, _Record):
            key = str(len(self.records))
            self.records[key] = obj.data
            return "storage", getattr(torch, obj.storage), key, "cpu", obj.claimed_numel
        return None


_STORAGE = {
    torch.float32: "FloatStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.float16: "HalfStorage",
    torch.int64: "LongStorage",
    torch.uint8: "ByteStorage",
    torch.int32: "IntStorage",
}


def write_torch_zip(path, obj, deflate=False):
    """``obj`` as a torch.save zip (archive/data.pkl + one record per storage), data.pkl deflated
    when asked (torch.save never compresses)."""
    records, pkl = {}, io.BytesIO()
    _TorchZipPickler(pkl, records).dump(obj)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            "archive/data.pkl", pkl.getvalue(), compress_type=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
        )
        zf.writestr("archive/byteorder", b"little")
        for key, data in records.items():
            zf.writestr(f"archive/data/{key}", data)


def rewrite_rank_file(path, change, deflate=False):
    with megatron_enums() as backend, torch.serialization.safe_globals(fixture_globals(backend)):
        state = torch.load(path, weights_only=True)
        write_torch_zip(path, change(state), deflate=deflate)


def _forge_view(state):
    """One weight replaced by a view of its shape with stride 1e11 over a 64-byte record that
    claims 10^13 elements: reading it as the numbers say would allocate 12.4 TB."""
    state["model"]["decoder.layers.0.mlp.linear_fc2.weight"] = _View(
        _Record(bytes(64), 10**13), 0, (32, 32), (10**11, 1)
    )
    return state


def _padded_args(state):
    """Megatron's state with 64 MiB of zeros in a field nobody reads: deflated, a few hundred KiB."""
    state["padding"] = bytes(64 * 2**20)
    return state


@pytest.mark.parametrize(
    "change, deflate, match",
    [
        (lambda s: s, False, None),  # the writer itself writes what import-megatron reads
        (
            _padded_args,
            True,
            r"record archive/data.pkl is compressed \(67,1\d\d,\d\d\d bytes inflated from .*"
            r"torch.save stores its records uncompressed",
        ),
        (
            _forge_view,
            False,
            r"a tensor view of shape \[32, 32\], strides \[100000000000, 1\] reaches past its storage "
            r"record data/\d+ \(16 elements of torch.float32\)",
        ),
        (lambda s: [s["model"]], False, r"holds a list, expected Megatron's saved dict"),
        (lambda s: "model", False, r"holds a str, expected Megatron's saved dict"),
    ],
    ids=["honest", "deflated", "forged-view", "list", "str"],
)
def test_hostile_rank_files_are_refused_naming_the_file(legacy, tmp_path, capsys, change, deflate, match):
    """Through the CLI: one error: line naming the rank file, no traceback, nothing written."""
    from tools.convert_checkpoint import main

    target = legacy / "iter_0000007" / "mp_rank_01_000" / "model_optim_rng.pt"
    rewrite_rank_file(target, change, deflate)
    dst = tmp_path / "dst"
    rc = main(["import-megatron", str(legacy), str(dst), "--no-progress"])
    err = capsys.readouterr().err
    if match is None:
        assert rc == 0, err
        return
    assert os.path.getsize(target) < 2**20
    assert (
        rc == 2 and "Traceback" not in err and re.search(r"error: .*mp_rank_01_000/model_optim_rng.pt: " + match, err)
    ), err
    assert not os.path.exists(dst)


def test_a_distributed_optimizer_file_that_does_not_fit_the_model(tmp_path):
    """distrib_optim.pt (Megatron-written, legacy DP2 fixture) whose flat buffer is not the length
    Megatron's buffer layout of the model gives, or that lacks a state, or (legacy EP2 fixture) that
    is not the list of the two chained optimizers' states; a model_optim_rng.pt beside
    it without one Adam step or without a valid iteration: refused naming the file and what was
    expected, nothing written."""
    from tests.convert.megatron.megatron_written import ROOT

    shutil.copytree(os.path.join(ROOT, "gpt_legacy_dp2_distopt", "checkpoint"), tmp_path / "src")
    rank_dir = tmp_path / "src" / "iter_0000003" / "mp_rank_00"
    path = str(rank_dir / "distrib_optim.pt")
    pristine = torch.load(path, weights_only=True)

    def rewrite(change):
        state = torch.load(path, weights_only=True)
        change(next(iter(state[0].values())))
        torch.save(state, path)

    rewrite(lambda flat: flat.update(numel_unpadded=flat["numel_unpadded"] - 64))
    fails(
        tmp_path / "src",
        re.escape(path) + r": buffer 0 holds \d+ elements, the layout of the model's 28 "
        r"parameters in Megatron's buffer has \d+",
    )
    torch.save(pristine, path)
    rewrite(lambda flat: flat.pop("exp_avg_sq"))
    fails(tmp_path / "src", re.escape(path) + r": buffer 0\['exp_avg_sq'\] is None, expected a flat tensor")
    torch.save({"buckets_coalesced": False}, path)
    fails(tmp_path / "src", re.escape(path) + ": not the distributed optimizer state Megatron-LM writes")
    shutil.copytree(os.path.join(ROOT, "mixtral_legacy_ep2_distopt", "checkpoint"), tmp_path / "chained")
    chained = str(tmp_path / "chained" / "iter_0000003" / "mp_rank_00_001" / "distrib_optim.pt")
    torch.save(torch.load(chained, weights_only=True)[1], chained)
    fails(
        tmp_path / "chained",
        re.escape(chained) + ": holds dict, expected a list of the states of megatron-core's "
        r"two chained optimizers \(dense, experts\) of an MoE model under expert parallelism",
    )
    torch.save(pristine, path)
    model_file = str(rank_dir / "model_optim_rng.pt")
    with torch.serialization.safe_globals([signal.Signals]):  # Megatron's args.exit_signal
        edit_rank_file(model_file, lambda state: state["optimizer"]["optimizer"]["param_groups"][1].update(step=2.0))
    fails(tmp_path / "src", re.escape(model_file) + r": optimizer.optimizer.param_groups give Adam steps \[2.0, 3.0\]")

    def no_iteration(state):
        state["optimizer"]["optimizer"]["param_groups"][1].update(step=3.0)
        state["iteration"] = -1

    with torch.serialization.safe_globals([signal.Signals]):
        edit_rank_file(model_file, no_iteration)
    fails(tmp_path / "src", re.escape(model_file) + r": iteration is -1, expected an integer >= 0")


def test_optimizer_state_lists_that_do_not_fit_the_model(tmp_path):
    """The non-distributed optimizer's lists in model_optim_rng.pt (Megatron-written fixture): a
    moment of another shape than its parameter's, or a param group of another size than the
    model's, is refused naming the file and the entry."""
    from tests.convert.megatron.megatron_written import ROOT

    shutil.copytree(os.path.join(ROOT, "gpt_legacy_tp1_adam", "checkpoint"), tmp_path / "src")
    path = str(tmp_path / "src" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    with torch.serialization.safe_globals([signal.Signals]):
        edit_rank_file(path, lambda state: state["optimizer"]["state"][1].update(exp_avg=torch.zeros(3)))
    fails(
        tmp_path / "src",
        re.escape(path) + r": optimizer.state\[1\]\['exp_avg'\] is of shape \[3\], expected a "
        r"tensor of embedding.position_embeddings.weight's shape \[32, 32\]",
    )
    shutil.copy(
        os.path.join(ROOT, "gpt_legacy_tp1_adam", "checkpoint", "iter_0000003", "mp_rank_00", "model_optim_rng.pt"),
        path,
    )
    with torch.serialization.safe_globals([signal.Signals]):
        edit_rank_file(path, lambda state: state["optimizer"]["param_groups"][1]["params"].pop())
    fails(
        tmp_path / "src",
        re.escape(path) + r": optimizer.param_groups\[1\] holds 17 parameters, the model's "
        "no-weight-decay group has 18",
    )


def test_distributed_optimizer_buckets_that_do_not_fit_the_model(tmp_path):
    """torch_dist with the distributed optimizer's buckets (Megatron-written dp_reshardable fixture):
    args whose DDP buckets (--overlap-grad-reduce, --ddp-bucket-size) do not give the saved bucket
    lengths are refused naming .metadata and both lengths; a sharding type that is not read, or a
    Transformer Engine model whose module order is not replayed, imports the weights only and the
    note names the file and why."""
    from tests.convert.megatron.megatron_written import ROOT

    shutil.copytree(os.path.join(ROOT, "gpt_dist_dp2_distopt", "checkpoint"), tmp_path / "src")
    iter_dir = tmp_path / "src" / "iter_0000003"
    common = str(iter_dir / "common.pt")
    pristine = open(common, "rb").read()

    def edit(change):
        with open(common, "wb") as fh:
            fh.write(pristine)
        with torch.serialization.safe_globals([signal.Signals]):
            edit_rank_file(common, change)

    edit(lambda state: vars(state["args"]).update(overlap_grad_reduce=True, ddp_bucket_size=4096))
    fails(
        tmp_path / "src",
        re.escape(str(iter_dir / ".metadata")) + r": the buckets of dp_group_idx_0 \(TP rank 0, "
        r"stage 0\) hold \[22784\] elements, the layout of the stage's 28 parameters in Megatron's buffer has "
        r"\[\d+, \d+",
    )
    for change, why in (
        (
            lambda state: state["optimizer"].update(param_state_sharding_type="fully_sharded_model_space"),
            re.escape(common) + ": the distributed optimizer's state is saved with sharding type "
            "'fully_sharded_model_space'; only dp_reshardable and fully_reshardable are read",
        ),
        (
            lambda state: vars(state["args"]).update(transformer_impl="transformer_engine"),
            re.escape(str(iter_dir / ".metadata")) + ": the distributed optimizer's state of sharding "
            "type 'dp_reshardable': the order of Transformer Engine's modules",
        ),
    ):
        edit(change)
        out, notes = import_megatron(str(tmp_path / "src"), str(tmp_path / "dst"), Target(), progress=False, force=True)
        assert re.search(
            r"weights only: Megatron's optimizer state, iteration and RNG states are not imported \(" + why,
            " ".join(notes),
        ), notes
        assert os.path.isdir(out)


def test_moe_distributed_optimizer_buckets_that_are_not_replayed(tmp_path):
    """torch_dist with an MoE model's two chained distributed optimizers (Megatron-written, EP2,
    GroupedMLP experts): args whose DDP buckets do not give the dense optimizer's saved bucket
    lengths are refused naming its group (chained_0); experts with their own TP size import the
    weights only, and the note says why."""
    from tests.convert.megatron.megatron_written import ROOT

    shutil.copytree(os.path.join(ROOT, "mixtral_dist_ep2_grouped_distopt", "checkpoint"), tmp_path / "src")
    iter_dir = tmp_path / "src" / "iter_0000003"
    common = str(iter_dir / "common.pt")
    pristine = open(common, "rb").read()
    for change, why in ((dict(expert_tensor_parallel_size=2), "the buffers of experts with their own TP size"),):
        with open(common, "wb") as fh:
            fh.write(pristine)
        with torch.serialization.safe_globals([signal.Signals]):
            edit_rank_file(common, lambda state: vars(state["args"]).update(change))
        out, notes = import_megatron(
            str(tmp_path / "src"), str(tmp_path / "weights"), Target(), progress=False, force=True
        )
        assert re.search(
            re.escape(str(iter_dir / ".metadata")) + ": the distributed optimizer's state of sharding "
            "type 'dp_reshardable': " + why,
            " ".join(notes),
        ), notes
        assert os.path.basename(out) == "iter_0000000"
    with open(common, "wb") as fh:
        fh.write(pristine)
    with torch.serialization.safe_globals([signal.Signals]):
        edit_rank_file(common, lambda state: vars(state["args"]).update(overlap_grad_reduce=True, ddp_bucket_size=4096))
    fails(
        tmp_path / "src",
        re.escape(str(iter_dir / ".metadata")) + r": the buckets of chained_0.dp_group_idx_0 "
        r"\(TP rank 0, stage 0\) hold \[11584\] elements, the layout of the stage's 8 parameters in "
        r"Megatron's buffer has \[4096, \d+",
    )


def test_legacy_grouped_experts_optimizer_state_is_named_as_not_read(tmp_path):
    """A legacy GroupedMLP checkpoint (Megatron-written, TP2) whose rank files hold the
    non-distributed optimizer's state lists imports its weights only, and the note names the file
    and that those lists are not read."""
    from tests.convert.megatron.megatron_written import ROOT

    shutil.copytree(os.path.join(ROOT, "mixtral_legacy_tp2_grouped", "checkpoint"), tmp_path / "src")
    paths = [
        str(tmp_path / "src" / "iter_0000003" / rank / "model_optim_rng.pt") for rank in ("mp_rank_00", "mp_rank_01")
    ]
    for path in paths:
        with torch.serialization.safe_globals([signal.Signals]):
            edit_rank_file(path, lambda state: state.update(optimizer={"state": {}, "param_groups": []}))
    out, notes = import_megatron(str(tmp_path / "src"), str(tmp_path / "dst"), Target(), progress=False)
    assert re.search(
        re.escape(paths[0]) + r": the non-distributed optimizer's state lists of GroupedMLP experts "
        r"\(mlp.experts.weight1, weight2\) are not read yet",
        " ".join(notes),
    ), notes
    assert os.path.basename(out) == "iter_0000000"


def test_a_legacy_optimizer_state_that_is_not_read_is_named(tmp_path):
    """A legacy rank file whose optimizer is not torch Adam's plain state dict (the --bf16/--fp16
    optimizer's nested one), or a distributed optimizer's rank file without its distrib_optim.pt:
    the weights import, and the note names the file and why the optimizer state is left out."""
    from tests.convert.megatron.megatron_written import ROOT

    shutil.copytree(os.path.join(ROOT, "gpt_legacy_tp1_adam", "checkpoint"), tmp_path / "lists")
    path = str(tmp_path / "lists" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    with torch.serialization.safe_globals([signal.Signals]):
        edit_rank_file(
            path,
            lambda state: state.update(
                optimizer={"optimizer": state["optimizer"], "fp32_from_fp16_params": [[torch.zeros(2)]]}
            ),
        )
    shutil.copytree(os.path.join(ROOT, "gpt_legacy_dp2_distopt", "checkpoint"), tmp_path / "distopt")
    rank_dir = tmp_path / "distopt" / "iter_0000003" / "mp_rank_00"
    (rank_dir / "distrib_optim.pt").unlink()
    for src, why in (
        (
            tmp_path / "lists",
            re.escape(path) + r": optimizer is a dict of \['fp32_from_fp16_params', "
            r"'optimizer'\], not torch Adam's state dict",
        ),
        (
            tmp_path / "distopt",
            re.escape(str(rank_dir / "model_optim_rng.pt")) + ": the distributed "
            "optimizer's distrib_optim.pt is not beside it",
        ),
    ):
        out, notes = import_megatron(str(src), str(tmp_path / "dst"), Target(), progress=False, force=True)
        assert re.search(
            r"weights only: Megatron's optimizer state, iteration and RNG states are not imported \(" + why,
            " ".join(notes),
        ), notes
        assert os.path.basename(out) == "iter_0000000"
