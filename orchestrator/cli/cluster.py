"""`diloco check-cluster`: does a cluster.yaml fit a training config? (orchestrator.deploy.cluster_check)

Prints each problem on one line and exits 1, or prints where each pool goes and exits 0; exit 2 when
the files themselves cannot be read.
"""

from __future__ import annotations

import argparse
import sys

from orchestrator.config import ConfigError, load_config

EXAMPLE = "example: diloco check-cluster --cluster cluster.yaml --config configs/multi-region.yaml"


def _cmd_check_cluster(args: argparse.Namespace) -> int:
    # Imported here (it imports Ray): building the `diloco` parser, for `diloco train` too, stays light.
    from orchestrator.deploy.cluster_check import check, load_cluster_yaml, pool_placements

    # The lines keep their `cluster_check:` prefix: docs and tests quote them.
    try:
        cluster_yaml = load_cluster_yaml(args.cluster)
        cfg = load_config(args.config, args.set)
    except ConfigError as err:
        print(f"cluster_check: {err}", file=sys.stderr)
        return 2
    problems = check(cluster_yaml, cfg, allow_public_dashboard=args.allow_public_dashboard)
    for msg in problems:
        print(f"cluster_check: {msg}", file=sys.stderr)
    if problems:
        return 1
    for line in pool_placements(cluster_yaml, cfg):
        print(line)
    print(f"ok: {len(cfg.pools)} pools fit {args.cluster}; token auth on; dashboard "
          f"{'opted in beyond localhost' if args.allow_public_dashboard else 'on localhost (ray dashboard ' + args.cluster + ')'}")
    return 0


def register(subparsers) -> None:
    """Add `check-cluster` to the `diloco` parser's subparsers."""
    p = subparsers.add_parser(
        "check-cluster", help="check a cluster.yaml against a training config (before `ray up`)",
        description="Check a cluster.yaml against a training config: Ray's validation, security defaults, pools.",
        epilog=EXAMPLE)
    p.add_argument("--cluster", default="cluster.yaml", help="the cluster.yaml given to `ray up`")
    p.add_argument("--config", default="configs/multi-region.yaml", help="the training config (RunConfig YAML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, as for diloco train")
    p.add_argument("--allow-public-dashboard", action="store_true",
                   help="accept a dashboard bound beyond localhost (you opened it on purpose, behind a firewall)")
    p.set_defaults(func=_cmd_check_cluster)
