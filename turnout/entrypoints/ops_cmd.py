"""`turnout ops`: the op dispatch table of this machine (`--json`), and the conformance suite (`--check`)."""


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the table (or --check results) as JSON")
    p.add_argument("--check", action="store_true",
                   help="run the conformance suite: every available implementation against the reference")
    p.add_argument("--op", action="append", metavar="NAME",
                   help="only this op (repeat, or comma-separate, for several)")
    p.add_argument("--device", default="auto", help="platform to inspect (default: auto)")
    p.add_argument("--where", metavar="OP",
                   help="the files of OP: its spec (reference, samples), every implementation, and its tests")


def run(args) -> int:
    from turnout.ops import doctor

    return doctor.main(as_json=args.json, check=args.check, device=args.device, ops=args.op, where_op=args.where)
