"""Parameter counts and state sizes of GPT settings, without allocating any weights.

    python model_size.py [--vocab-size 65] [--block-size 128]

A snapshot holds the fp32 model state plus AdamW's two moments per parameter: about 3x the model.
"""
from typing import Optional

from mingpt.common.errors import OneLineArgumentParser, command
from mingpt.model import DEFAULT_SIZES, PRESETS, GPTConfig, meta_model

DEFAULT = "default (gpt2_train_cfg.yaml)"
SETTINGS: dict[str, tuple[int, int, int]] = {DEFAULT: tuple(DEFAULT_SIZES.values()), **PRESETS}


def measure(n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int) -> tuple[int, int]:
    """(parameter count, model state-dict bytes) of one setting, built on the meta device."""
    model = meta_model(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                 vocab_size=vocab_size, block_size=block_size))
    params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return params, state_bytes


def table(vocab_size: int, block_size: int) -> str:
    header = (f"{'setting':<28} {'layers':>6} {'heads':>5} {'embd':>5} {'params':>13} "
              f"{'model MB':>9} {'snapshot MB':>11}")
    rows = [header, "-" * len(header)]
    for name, (n_layer, n_head, n_embd) in SETTINGS.items():
        params, state_bytes = measure(n_layer, n_head, n_embd, vocab_size, block_size)
        rows.append(f"{name:<28} {n_layer:>6} {n_head:>5} {n_embd:>5} {params:>13,} "
                    f"{state_bytes / 1e6:>9.1f} {3 * state_bytes / 1e6:>11.1f}")
    return "\n".join(rows)


@command
def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=65, help="tiny-shakespeare has 65 characters")
    parser.add_argument("--block-size", type=int, default=128)
    args = parser.parse_args(argv)
    print(table(args.vocab_size, args.block_size))


if __name__ == "__main__":
    main()
