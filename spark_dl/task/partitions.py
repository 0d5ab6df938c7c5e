"""Barrier task: write this partition's rows to local Arrow files, one per DataFrame, for its rank
to read (:class:`spark_dl.rank.shards.Shards`)."""
from __future__ import annotations

import os
from typing import Any, Iterator

# the column that tags each row with its DataFrame when several travel as one union (ShardSet)
DATASET_TAG = "__spark_dl_dataset"


def write_partitions(batches: Iterator, directory: str, schemas: dict[str, Any]) -> None:
    """Barrier task: this partition's rows, one Arrow file per DataFrame (``<key>.arrow``); with
    several, each batch is split by ``DATASET_TAG`` and each key's struct column unpacked."""
    if len(schemas) == 1:
        key, schema = next(iter(schemas.items()))
        write_partition(batches, os.path.join(directory, f"{key}.arrow"), schema)
        return
    import pyarrow as pa
    import pyarrow.compute as pc

    sinks = {key: pa.OSFile(os.path.join(directory, f"{key}.arrow"), "wb") for key in schemas}
    writers = {key: pa.ipc.new_file(sinks[key], schema) for key, schema in schemas.items()}
    try:
        for batch in batches:
            tags = batch.column(DATASET_TAG)
            for key, schema in schemas.items():
                rows = batch.column(key).filter(pc.equal(tags, key))
                if len(rows):
                    writers[key].write_batch(pa.RecordBatch.from_arrays(rows.flatten(), schema=schema))
    finally:
        for key in schemas:
            writers[key].close()
            sinks[key].close()


def write_partition(batches: Iterator, path: str, schema) -> int:
    """Barrier task: stream this partition's Arrow batches to a local Arrow file; return its rows.
    An empty partition still gets a file with the schema (a rank with no rows serves none)."""
    import pyarrow as pa

    rows = 0
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(pa.RecordBatch.from_arrays(batch.columns, schema=schema))  # the real names
            rows += batch.num_rows
    return rows
