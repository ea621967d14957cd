"""Merge the Megatron `.bin/.idx` datasets in a directory into one (Megatron-LM's `tools/merge_datasets.py`).

Every `{prefix}.bin`/`{prefix}.idx` pair in `--input` is appended, in sorted prefix order, to
`{output_prefix}.bin/.idx`; documents and tokens are kept as they are. All inputs must share one token dtype.

    python tools/merge_datasets.py --input data/parts --output-prefix data/merged_text_document
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)


def find_prefixes(directory: str):
    """Sorted prefixes of the `.bin/.idx` pairs in `directory`; a file of a pair without its partner is an error."""
    names = [name for name in os.listdir(directory) if os.path.isfile(os.path.join(directory, name))]
    stems = {os.path.splitext(name)[0] for name in names if name.endswith((".bin", ".idx"))}
    prefixes = []
    for stem in sorted(stems):
        for suffix, partner in ((".bin", ".idx"), (".idx", ".bin")):
            if stem + suffix in names and stem + partner not in names:
                raise FileNotFoundError(f"{os.path.join(directory, stem + suffix)} has no matching {partner} file")
        prefixes.append(os.path.join(directory, stem))
    if not prefixes:
        raise FileNotFoundError(f"--input {directory}: no .bin/.idx pairs to merge")
    return prefixes


def merge(prefixes, output_prefix: str, multimodal: bool = False) -> None:
    """Append every dataset in `prefixes` to a new dataset at `output_prefix`, using the first one's dtype."""
    dtype = IndexedDataset(prefixes[0], multimodal=multimodal).dtype
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=dtype, multimodal=multimodal)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(get_idx_path(output_prefix))
    except BaseException:
        builder.abort()
        raise


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True, help="directory containing the .bin/.idx pairs to merge")
    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix", type=str, required=True, help="path of the merged dataset, without the .bin/.idx suffix"
    )
    group = parser.add_argument_group(title="miscellaneous")
    group.add_argument("--multimodal", action="store_true", help="the datasets hold a mode per sequence")
    args = parser.parse_args(argv)

    if not os.path.isdir(args.input):
        parser.error(f"--input {args.input}: not a directory")
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(output_dir):
        parser.error(f"--output-prefix {args.output_prefix}: directory {output_dir} does not exist")
    if os.path.samefile(output_dir, args.input):
        parser.error(
            f"--output-prefix {args.output_prefix} is inside --input {args.input}; a rerun would merge "
            f"the output into itself, so write it to another directory"
        )
    return args


def main(argv=None):
    args = get_args(argv)
    prefixes = find_prefixes(args.input)
    merge(prefixes, args.output_prefix, args.multimodal)
    merged = IndexedDataset(args.output_prefix, multimodal=args.multimodal)
    print(
        f"merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx: "
        f"{len(merged.document_indices) - 1} documents, {len(merged)} sequences",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    from megatron.training.error_handling import tool_main

    tool_main(main)
