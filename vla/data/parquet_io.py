"""Arrow/Parquet columns of LeRobot data files, and the PNG bytes of images embedded in them.

Column encoding (what LeRobot writes through Hugging Face `datasets`):
- numeric feature of shape (1,): a scalar column of that dtype;
- numeric feature of shape (D,): fixed_size_list<dtype>[D];
- camera feature stored as "image": struct<bytes: binary, path: string> holding a PNG.
The schema carries `datasets`' "huggingface" metadata so `datasets.load_dataset("parquet", ...)`
decodes the image columns as images too.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from vla.data.errors import DatasetFileNotFoundError, DatasetFormatError, corrupt_file_error

IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
PNG_COMPRESS_LEVEL = 6  # LeRobot's level for image features: smaller files, decode speed unchanged


# What pyarrow raises on a truncated, zero-byte or garbled file: ArrowInvalid ("magic bytes not found",
# "file size is 0 bytes"), OSError ("Couldn't deserialize thrift", "Unexpected end of stream"), ...
_PARQUET_ERRORS = (pa.ArrowException, OSError, ValueError, EOFError)


def read_parquet_schema(path: Path) -> pa.Schema:
    """The schema of a parquet file; DatasetFormatError naming the file when it is damaged."""
    try:
        return pq.read_schema(path)
    except FileNotFoundError as exc:
        raise DatasetFileNotFoundError(f"Missing parquet file {path}.") from exc
    except _PARQUET_ERRORS as exc:
        raise corrupt_file_error(path, "parquet file", exc) from exc


def read_parquet_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    """`columns` (None: all) of a parquet file; DatasetFormatError naming the file when it is damaged."""
    try:
        return pq.read_table(path, columns=columns)
    except FileNotFoundError as exc:
        raise DatasetFileNotFoundError(f"Missing parquet file {path}.") from exc
    except _PARQUET_ERRORS as exc:
        raise corrupt_file_error(path, "parquet file", exc) from exc


def arrow_type(feature: dict[str, Any]) -> pa.DataType:
    if feature["dtype"] == "image":
        return IMAGE_STRUCT
    value_type = pa.from_numpy_dtype(np.dtype(feature["dtype"]))
    shape = tuple(feature["shape"])
    if shape == (1,):
        return value_type
    if len(shape) == 1:
        return pa.list_(value_type, shape[0])
    raise DatasetFormatError(
        f"numeric features must have shape (1,) or (D,); got {list(shape)}. Flatten the feature."
    )


def _hf_feature(feature: dict[str, Any]) -> dict[str, Any]:
    if feature["dtype"] == "image":
        return {"_type": "Image"}
    value = {"dtype": feature["dtype"], "_type": "Value"}
    if tuple(feature["shape"]) == (1,):
        return value
    return {"feature": value, "length": feature["shape"][0], "_type": "List"}


def data_schema(features: dict[str, dict[str, Any]]) -> pa.Schema:
    """Schema of data/*.parquet: every non-video feature, in `features` order."""
    stored = {k: ft for k, ft in features.items() if ft["dtype"] != "video"}
    metadata = {
        "huggingface": json.dumps({"info": {"features": {k: _hf_feature(f) for k, f in stored.items()}}})
    }
    return pa.schema([(k, arrow_type(f)) for k, f in stored.items()], metadata=metadata)


def column_from_numpy(values: np.ndarray, feature: dict[str, Any]) -> pa.Array:
    """(N,) or (N, D) values -> the Arrow column for `feature`."""
    target = arrow_type(feature)
    if pa.types.is_fixed_size_list(target):
        flat = pa.array(np.ascontiguousarray(values, dtype=feature["dtype"]).reshape(-1))
        return pa.FixedSizeListArray.from_arrays(flat, target.list_size)
    return pa.array(np.asarray(values, dtype=feature["dtype"]).reshape(-1), type=target)


def image_column(png_frames: list[bytes], first_frame_index: int) -> pa.Array:
    paths = [f"frame-{first_frame_index + i:06d}.png" for i in range(len(png_frames))]
    return pa.StructArray.from_arrays(
        [pa.array(png_frames, type=pa.binary()), pa.array(paths, type=pa.string())], fields=list(IMAGE_STRUCT)
    )


def column_to_numpy(
    column: pa.ChunkedArray | pa.Array, feature: dict[str, Any], key: str, path: Path
) -> np.ndarray:
    """A numeric column -> (N,) for shape (1,) features, else (N, *shape); checks the shape."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    num_rows = len(array)
    shape = tuple(feature["shape"])
    while (
        pa.types.is_list(array.type)
        or pa.types.is_fixed_size_list(array.type)
        or pa.types.is_large_list(array.type)
    ):
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=False)
    expected = int(np.prod(shape))
    if values.size != num_rows * expected:
        found = values.size / max(num_rows, 1)
        raise DatasetFormatError(
            f"{path}: column {key!r} holds {found:g} values per frame but meta/info.json declares shape "
            f"{list(shape)}. Fix the feature shape in info.json or re-create the data file."
        )
    values = values.astype(feature["dtype"], copy=False)
    return values.reshape(num_rows) if shape == (1,) else values.reshape(num_rows, *shape)


def encode_png(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def decode_png(data: bytes) -> np.ndarray:
    """PNG/JPEG bytes -> (H, W, 3) uint8."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))
