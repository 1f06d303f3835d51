"""Turn a sharded snapshot (`trainer_config.snapshot_format=sharded`) into one single-file snapshot.

    python mingpt/convert_snapshot.py SNAPSHOT_FOLDER out.pt               the run's newest
    python mingpt/convert_snapshot.py SNAPSHOT_FOLDER/sharded_<step> out.pt   that one

Local paths or fsspec URLs. Runs in one process, with no process group. (generate.py and
export_hf.py read sharded snapshots themselves; this is for any other single-file reader.)
"""
from typing import Optional

from mingpt.common.errors import OneLineArgumentParser, SnapshotError, command
from mingpt.storage.sharded_store import to_single_file
from mingpt.storage.snapshot import sharded_snapshot_at

KEY = "SHARDED_FOLDER"


@command
def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineArgumentParser(description="Convert a sharded snapshot folder to one .pt file.")
    parser.add_argument("sharded_folder", metavar=KEY,
                        help="a run's snapshot folder (its newest complete one), or a sharded_<step> one")
    parser.add_argument("out_path", help="the single-file snapshot to write (local or fsspec URL)")
    args = parser.parse_args(argv)
    sharded = sharded_snapshot_at(args.sharded_folder, key=KEY)
    if sharded is None:
        raise SnapshotError(f"no complete sharded snapshot at {args.sharded_folder}; give the folder of a "
                            "run with trainer_config.snapshot_format=sharded, or one of its sharded_<step> "
                            "folders")
    to_single_file(sharded, args.out_path)
    print(f"wrote {args.out_path} (from {sharded})")


if __name__ == "__main__":
    main()
