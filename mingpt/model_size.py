"""Parameter counts and state sizes of GPT settings, without allocating any weights.

    python model_size.py [--vocab-size 65] [--block-size 128] [--config-name laptop] [overrides]

Hydra overrides, as for main.py (`gpt_config.n_layer=12`, `gpt_config.model_type=gpt2 ...`), and a
config of your own (`--config-name laptop`) add a row for the model they configure, with
data_config.block_size for its block. A snapshot holds the model state plus AdamW's two fp32 moments
per parameter (its progress, RNG states and vocabulary are a few kB more).
"""
from typing import Optional

from mingpt.common.errors import OneLineArgumentParser, check, command
from mingpt.model import DEFAULT_SIZES, PRESETS, GPTConfig, meta_model
from mingpt.run_config import DEFAULT_CONFIG

Sizes = tuple[int, int, int]
"""n_layer, n_head, n_embd."""
DEFAULT = "default (gpt2_train_cfg.yaml)"
CONFIGURED = "your overrides"
SETTINGS: dict[str, Sizes] = {DEFAULT: tuple(DEFAULT_SIZES.values()), **PRESETS}


def measure(n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int) -> tuple[int, int]:
    """(parameter count, model state-dict bytes with the vocabulary's padding) of one setting, built
    on the meta device."""
    model = meta_model(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                 vocab_size=vocab_size, block_size=block_size))
    params = model.num_parameters()
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return params, state_bytes


def snapshot_bytes(n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int) -> int:
    """A snapshot's tensors: the model state and AdamW's two fp32 moments of every trainable parameter."""
    model = meta_model(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                 vocab_size=vocab_size, block_size=block_size))
    moments = sum(2 * 4 * p.numel() for p in model.parameters() if p.requires_grad)
    return measure(n_layer, n_head, n_embd, vocab_size, block_size)[1] + moments


def table(vocab_size: int, block_size: int, configured: Optional[tuple[Sizes, int]] = None) -> str:
    """One row per setting; configured: the sizes and block of the model the overrides give."""
    header = (f"{'setting':<28} {'layers':>6} {'heads':>5} {'embd':>5} {'params':>13} "
              f"{'model MB':>9} {'snapshot MB':>11}")
    rows = [header, "-" * len(header)]
    settings = [(name, sizes, block_size) for name, sizes in SETTINGS.items()]
    if configured is not None:
        settings.append((CONFIGURED, *configured))
    for name, (n_layer, n_head, n_embd), block in settings:
        params, state_bytes = measure(n_layer, n_head, n_embd, vocab_size, block)
        snapshot = snapshot_bytes(n_layer, n_head, n_embd, vocab_size, block)
        rows.append(f"{name:<28} {n_layer:>6} {n_head:>5} {n_embd:>5} {params:>13,} "
                    f"{state_bytes / 1e6:>9.1f} {snapshot / 1e6:>11.1f}")
    return "\n".join(rows)


def configured_model(overrides: list[str], config_name: str) -> Optional[tuple[Sizes, int]]:
    """The sizes and block of the model main.py would build with this config (None: neither overrides
    nor a config of its own given)."""
    if not overrides and config_name == DEFAULT_CONFIG:
        return None
    from mingpt.run_config import from_command_line

    config = from_command_line(overrides, "model_size.py", config_name)
    model = config.gpt_config
    check(not model.init_from, "gpt_config.init_from",
          "a model folder sets its own sizes: see its config.json")
    return (model.n_layer, model.n_head, model.n_embd), config.data_config.block_size


@command
def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0],
                                   epilog="Anything else is a Hydra override, as for main.py.")
    parser.add_argument("--vocab-size", type=int, default=65,
                        help="tiny-shakespeare has 65 characters (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=128,
                        help="of the table's settings (default: %(default)s)")
    parser.add_argument("--config-name", default=DEFAULT_CONFIG,
                        help="a YAML beside gpt2_train_cfg.yaml whose model to add to the table, as main.py's "
                        "--config-name (default: %(default)s)")
    args, overrides = parser.parse_known_args(argv)
    print(table(args.vocab_size, args.block_size, configured_model(overrides, args.config_name)))


if __name__ == "__main__":
    main()
