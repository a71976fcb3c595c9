"""Our GGUF header parser against the `gguf` package's reader, on the default model and
on a file written by the `gguf` package's writer with every metadata value type."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from model.checkpoint.default_model import default_model_path
from model.checkpoint.gguf_file import open_gguf
from model.errors import ModelFileError


def reference_value(field):
    """A field as plain Python, read from GGUFReader's parts."""
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def assert_same_as_reader(path: Path) -> None:
    ours, reader = open_gguf(path), GGUFReader(path)
    expected = {name: reference_value(f) for name, f in reader.fields.items()}
    expected = {k: v for k, v in expected.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in theirs.shape)
        assert mine.tensor_type == theirs.tensor_type
        assert bytes(ours.read(mine)) == np.asarray(theirs.data).tobytes(), mine.name


def test_default_model_reads_as_the_gguf_reader_reads_it() -> None:
    assert_same_as_reader(default_model_path())


def test_every_value_type_and_alignment(tmp_path: Path) -> None:
    path = tmp_path / "values.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_uint8("u8", 200)
    writer.add_int8("i8", -5)
    writer.add_uint16("u16", 60000)
    writer.add_int16("i16", -30000)
    writer.add_uint32("u32", 4_000_000_000)
    writer.add_int32("i32", -2_000_000_000)
    writer.add_float32("f32", 0.25)
    writer.add_uint64("u64", 2**60)
    writer.add_int64("i64", -(2**60))
    writer.add_float64("f64", 1e-300)
    writer.add_bool("yes", True)
    writer.add_string("text", "héllo ✓")
    writer.add_array("ints", [1, 2, 3])
    writer.add_array("words", ["a", "", "ünï"])
    writer.add_custom_alignment(64)
    writer.add_tensor("a", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b", np.ones(5, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_reader(path)
    assert open_gguf(path).metadata["words"] == ["a", "", "ünï"]


@pytest.mark.parametrize("cut", [0, 3, 24, 200])
def test_a_cut_file_is_one_model_file_error(tmp_path: Path, cut: int) -> None:
    whole = default_model_path().read_bytes()[: 1 << 20]
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:cut])
    with pytest.raises(ModelFileError, match="not a readable GGUF file"):
        open_gguf(path)
