"""``fivefold fuse``: the fusion job (fivefold/jobs/fuse.py)."""

from __future__ import annotations

from fivefold.errors import FivefoldError


def add_parser(sub) -> None:
    """``fivefold fuse``'s arguments."""
    fz = sub.add_parser("fuse", help="fuse a CNN or encoder (fold BN, fuse activations, channels_last), "
                                     "measure it against eager, write a directory")
    fz.add_argument("--model", default="resnet18", help="resnet18, mobilenet_v2, all-minilm-l6-v2 or a BERT directory")
    fz.add_argument("--out", required=True, help="output directory")
    fz.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes to time (default 1,32)")
    fz.add_argument("--image-size", type=int, default=224, help="CNN input height and width")
    fz.add_argument("--seq-len", type=int, default=64, help="encoder input length in tokens")
    fz.add_argument("--no-channels-last", action="store_true")
    fz.add_argument("--no-align", action="store_true", help="do not time packed/padded layouts for linears")


def run(args) -> int:
    from fivefold.jobs.fuse import FuseJob, run_fuse
    from fivefold.fuse.graph_fuse import FuseConfig

    try:
        batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    except ValueError:
        raise FivefoldError(f"--batch-sizes must be comma-separated integers, got '{args.batch_sizes}'") from None
    config = FuseConfig(channels_last=not args.no_channels_last, align_linears=not args.no_align)
    run_fuse(FuseJob(args.model, args.out, batch_sizes, args.image_size, args.seq_len, config=config))
    return 0
