"""Packs what a bare GPU machine needs into three ignored folders, ``.gpu1`` to ``.gpu3``,
each small enough for one device call (64 MiB a call): the default model's GGUF in three
parts, the server packages' wheels for the device's Python (gguf, pyzmq), MT-Bench's
questions, a compact ShareGPT file in two parts, and the default model's tokenizer alone (its
GGUF's metadata, no tensors: ``tokenizer/``), so that the first call can already run the
dummy models, which borrow that tokenizer.

The compact ShareGPT file keeps the record indices of the real one: its first ``--head``
records whole (the steady-state and throughput benchmarks read from the start), then an
empty object for every record up to ``--held-out-from`` (16,000: where `bench spec`'s
held-out first turns start), then ``--held-out`` records whole. On the device,
``source scripts/device_unpack.sh`` at the start of every call gathers the parts as they
arrive (one folder a call, named in the call's ``carry``) and exports ``MODEL``,
``SHAREGPT_JSON`` and ``MTBENCH_JSONL`` once all are there.

Usage: .venv/bin/python scripts/device_pack.py [--head 4096] [--held-out 400]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from tandem.bench.datasets import (
    SHAREGPT_HELD_OUT_FROM,
    iter_sharegpt,
    mtbench_path,
    package_dir,
    sharegpt_path,
)
from tandem.models.loader import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE

FOLDERS = (".gpu1", ".gpu2", ".gpu3")
DEVICE_PYTHON = "3.12"
WHEELS = ("gguf", "pyzmq")


def split(path: str, name: str, folders: tuple[str, ...]) -> None:
    """``path`` in ``len(folders)`` nearly equal parts, ``NAME.partI`` in folder I, and
    ``NAME.parts`` (their number) beside the first: what device_unpack.sh joins, and when."""
    size = os.path.getsize(path)
    step = -(-size // len(folders))
    with open(path, "rb") as f:
        for i, folder in enumerate(folders):
            with open(os.path.join(folder, f"{name}.part{i}"), "wb") as part:
                part.write(f.read(step))
    with open(os.path.join(folders[0], f"{name}.parts"), "w") as f:
        f.write(f"{len(folders)}\n")


def tokenizer_only(source: str, out: str) -> None:
    """A GGUF holding ``source``'s metadata (its architecture, hyperparameters and
    tokenizer) and no tensors: what a dummy model's borrowed tokenizer is read from."""
    import gguf

    reader = gguf.GGUFReader(source)

    def text(field, index: int) -> str:
        return bytes(field.parts[index]).decode("utf-8", "surrogateescape")

    architecture = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(out, text(architecture, architecture.data[0]))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the file's own header, and the key the writer adds
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            item = field.types[1]
            if item == gguf.GGUFValueType.STRING:
                value = [text(field, i) for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(name, value, kind, sub_type=item)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, text(field, field.data[0]), kind)
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def compact_sharegpt(source: str, out: str, head: int, held_out_from: int, held_out: int) -> int:
    """Writes the compact ShareGPT list (see the module docstring); returns its records."""
    count = 0
    with open(out, "w", encoding="utf-8") as f:
        f.write("[")
        for index, record in enumerate(iter_sharegpt(source)):
            if index >= held_out_from + held_out:
                break
            kept = index < head or index >= held_out_from
            f.write(("," if index else "") + (json.dumps(record) if kept else "{}"))
            count += 1
        f.write("]")
    if count < held_out_from + held_out:
        raise ValueError(f"ShareGPT holds {count} records, {held_out_from + held_out} needed")
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", type=int, default=4096)
    parser.add_argument("--held-out-from", type=int, default=SHAREGPT_HELD_OUT_FROM)
    parser.add_argument("--held-out", type=int, default=400)
    args = parser.parse_args()
    for folder in FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    model = os.path.join(package_dir(DEFAULT_MODEL_PACKAGE), DEFAULT_MODEL_FILE)
    split(model, DEFAULT_MODEL_FILE, FOLDERS)
    os.makedirs(os.path.join(FOLDERS[0], "tokenizer"))
    tokenizer_only(model, os.path.join(FOLDERS[0], "tokenizer", DEFAULT_MODEL_FILE))
    compact = os.path.join(FOLDERS[0], "sharegpt.json")
    records = compact_sharegpt(
        sharegpt_path(), compact, args.head, args.held_out_from, args.held_out
    )
    split(compact, "sharegpt.json", FOLDERS[1:])
    os.remove(compact)
    shutil.copy(mtbench_path(), os.path.join(FOLDERS[0], "question.jsonl"))
    wheels = os.path.join(FOLDERS[0], "wheels")
    platforms = ("manylinux2014_x86_64", "manylinux_2_28_x86_64")
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels]
    download += ["--only-binary=:all:", "--python-version", DEVICE_PYTHON]
    subprocess.run(
        download + [arg for p in platforms for arg in ("--platform", p)] + list(WHEELS),
        check=True,
    )
    for folder in FOLDERS:
        mib = sum(
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(folder)
            for name in names
        )
        print(f"{folder}: {mib / 2**20:.1f} MiB")
    print(f"ShareGPT: {records} records, the first {args.head} and the last {args.held_out} whole")


if __name__ == "__main__":
    main()
