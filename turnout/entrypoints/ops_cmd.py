def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--check", action="store_true", help="run the conformance suite on this machine")
    p.add_argument("--device", default="auto", help="platform to inspect (default: auto)")


def run(args) -> int:
    from turnout.ops import doctor

    return doctor.main(as_json=args.json, check=args.check, device=args.device)
