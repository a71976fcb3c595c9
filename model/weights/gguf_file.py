"""Opens a GGUF file once and exposes its metadata as plain Python values.

Parsing a GGUF takes seconds (the vocabulary alone is ~50k strings), so every consumer
(config, tokenizer, chat template, weights) shares one `GGUFFile`.

It must never dequantise or copy tensor data: readers stream that from the file.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

from model.errors import ModelFileError


@dataclass
class GGUFFile:
    path: Path
    reader: GGUFReader
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def _field_value(f: Any) -> Any:
    """Decodes one metadata field: strings as str, arrays as lists, scalars as Python numbers."""
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        if len(f.types) > 1 and f.types[1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if f.types and f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    value = f.parts[f.data[0]].tolist()
    return value[0] if len(value) == 1 else value


def open_gguf(path: str | Path) -> GGUFFile:
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such model file")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises bare ValueErrors/struct errors on corrupt files
        raise ModelFileError(f"{path}: not a readable GGUF file ({exc})") from None
    metadata = {name: _field_value(f) for name, f in reader.fields.items()}
    return GGUFFile(path=path, reader=reader, metadata=metadata)
