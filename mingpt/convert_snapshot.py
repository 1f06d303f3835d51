"""Turn a sharded snapshot (`trainer_config.snapshot_format=sharded`) into one single-file snapshot.

    python mingpt/convert_snapshot.py SNAPSHOT_FOLDER/sharded_<step> out.pt     (local or fsspec URLs)

Runs in one process, with no process group: generate.py and any single-file reader can then use it.
"""
from typing import Optional

from mingpt.common.errors import OneLineArgumentParser, command
from mingpt.storage.sharded_store import to_single_file


@command
def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineArgumentParser(description="Convert a sharded snapshot folder to one .pt file.")
    parser.add_argument("sharded_folder", help="a sharded_<step> folder (local or fsspec URL)")
    parser.add_argument("out_path", help="the single-file snapshot to write (local or fsspec URL)")
    args = parser.parse_args(argv)
    to_single_file(args.sharded_folder, args.out_path)
    print(f"wrote {args.out_path}")


if __name__ == "__main__":
    main()
