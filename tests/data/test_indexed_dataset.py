import struct

import numpy as np
import pytest

from megatron_p2r.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, best_dtype


def write_dataset(prefix, docs, dtype):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(f"{prefix}.idx")


def random_docs(rng, count, vocab):
    return [rng.integers(0, vocab, size=rng.integers(0, 50)) for _ in range(count)]


def test_best_dtype_follows_megatron():
    assert best_dtype(65499) is np.uint16
    assert best_dtype(65500) is np.int32
    assert best_dtype(None) is np.int32


@pytest.mark.parametrize("vocab", [50_000, 200_000])
def test_round_trip(tmp_path, vocab):
    rng = np.random.default_rng(0)
    docs = random_docs(rng, 40, vocab)
    dtype = best_dtype(vocab)
    write_dataset(tmp_path / "d", docs, dtype)
    ds = IndexedDataset(str(tmp_path / "d"))
    assert ds.dtype == np.dtype(dtype) and len(ds) == 40 and ds.num_documents == 40
    np.testing.assert_array_equal(ds.sequence_lengths, [len(d) for d in docs])
    np.testing.assert_array_equal(ds.document_indices, np.arange(41))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
        if len(doc) > 3:
            np.testing.assert_array_equal(ds.get(i, 2, len(doc) - 3), doc[2:-1])
            np.testing.assert_array_equal(ds.get(i, 1), doc[1:])
    np.testing.assert_array_equal(ds[-1], docs[-1])
    with pytest.raises(IndexError, match="out of range"):
        ds[40]
    with pytest.raises(IndexError, match="slice"):
        ds.get(0, 0, len(docs[0]) + 1)


def test_builder_rejects_ids_that_do_not_fit(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="uint16"):
        builder.add_document([1, 70_000])


def megatron_bytes(code, lengths, pointers, doc_index):
    """A .idx laid out from the Megatron-LM format description, independently of our writer."""
    return (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)
        + struct.pack("<B", code)
        + struct.pack("<Q", len(lengths))
        + struct.pack("<Q", len(doc_index))
        + struct.pack(f"<{len(lengths)}i", *lengths)
        + struct.pack(f"<{len(pointers)}q", *pointers)
        + struct.pack(f"<{len(doc_index)}q", *doc_index)
    )


def test_hand_written_megatron_files_read_and_match_writer(tmp_path):
    # Three int32 sequences; document 0 holds sequences 0 and 1, document 1 holds sequence 2.
    seqs = [[5, 6, 7], [8], [9, 10]]
    (tmp_path / "h.idx").write_bytes(megatron_bytes(4, [3, 1, 2], [0, 12, 16], [0, 2, 3]))
    (tmp_path / "h.bin").write_bytes(struct.pack("<6i", 5, 6, 7, 8, 9, 10))
    ds = IndexedDataset(str(tmp_path / "h"))
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_documents == 2
    for i, seq in enumerate(seqs):
        assert ds[i].tolist() == seq
    assert ds.document_indices.tolist() == [0, 2, 3]
    builder = IndexedDatasetBuilder(str(tmp_path / "w.bin"), np.int32)
    builder.add_item(seqs[0])
    builder.add_item(seqs[1])
    builder.end_document()
    builder.add_document(seqs[2])
    builder.finalize(str(tmp_path / "w.idx"))
    assert (tmp_path / "w.idx").read_bytes() == (tmp_path / "h.idx").read_bytes()
    assert (tmp_path / "w.bin").read_bytes() == (tmp_path / "h.bin").read_bytes()


def test_uint16_code_is_8(tmp_path):
    write_dataset(tmp_path / "u", [[1, 2, 65535]], np.uint16)
    raw = (tmp_path / "u.idx").read_bytes()
    assert raw[17] == 8
    assert (tmp_path / "u.bin").read_bytes() == struct.pack("<3H", 1, 2, 65535)


def test_empty_dataset(tmp_path):
    write_dataset(tmp_path / "e", [], np.uint16)
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.num_documents == 0


@pytest.fixture
def good(tmp_path):
    write_dataset(tmp_path / "g", [[1, 2, 3], [4, 5]], np.int32)
    return tmp_path / "g"


def corrupt(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "offset,data,message",
    [
        (0, b"XXIDIDX", r"g\.idx.*header b'XXIDIDX"),
        (9, struct.pack("<Q", 2), r"g\.idx.*version 2, expected 1"),
        (17, b"\x63", r"g\.idx.*dtype code 99"),
        (18, struct.pack("<Q", 3), r"g\.idx.*expected \d+ for 3 sequences"),
        (len(megatron_bytes(4, [3, 2], [0, 12], [0, 1, 2])) - 8, struct.pack("<q", 1), r"g\.idx.*document index"),
    ],
)
def test_corrupt_index(good, offset, data, message):
    corrupt(good.with_suffix(".idx"), offset, data)
    with pytest.raises(ValueError, match=message):
        IndexedDataset(str(good))


def test_truncated_index(good):
    idx = good.with_suffix(".idx")
    idx.write_bytes(idx.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"g\.idx.*truncated"):
        IndexedDataset(str(good))
    idx.write_bytes(b"MMIDIDX")
    with pytest.raises(ValueError, match=r"g\.idx.*shorter than the 34-byte header"):
        IndexedDataset(str(good))


def test_bin_that_does_not_match_index(good):
    bin_path = good.with_suffix(".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"g\.bin: 16 bytes, but .*g\.idx describes 20 bytes"):
        IndexedDataset(str(good))
    bin_path.unlink()
    with pytest.raises(FileNotFoundError, match=r"g\.bin"):
        IndexedDataset(str(good))
