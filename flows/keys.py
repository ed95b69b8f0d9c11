"""``bcdflow config show [--run RUN [--store URL]] [-c FILE] [--set KEY=VALUE ...]``: the resolved run config, every
key with its value and its meaning (the field's description in core/config.py, the one place a key is documented in
code).

    bcdflow config show                               # the defaults
    bcdflow config show -c run.yaml --set bcd.blocks=4
    bcdflow config show --run bcd-20250101-120000-1a2b   # a stored run's settings (as --like RUN starts from them)
    bcdflow config show --json                        # {key: {"value": ..., "meaning": ...}}

The text form is YAML, each key's meaning as its comment: it is itself a valid ``-c`` file. Keys set by the file,
``--set`` or the stored run (values other than the defaults) are marked ``(set)``. ``--run`` reads the run's
config.json from the store (flows/like.py; a run that is missing or damaged is one line naming it, exit 2); nothing
is checked against the machine, and nothing is written.
"""
from __future__ import annotations

import yaml

from bcdflow.tracking.tables import strict_json


def add_parser(sub, common) -> None:
    sp = sub.add_parser("config", parents=[common], help="show the resolved config, each key with its meaning")
    verbs = sp.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser("show", parents=[common], help="every key: its value (defaults, -c, --set) and meaning")
    show.add_argument("-c", "--config", help="YAML config file")
    show.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (repeatable)")
    show.add_argument("--json", action="store_true", help="{key: {value, meaning}} as JSON")
    show.add_argument("--run", "--like", dest="like", metavar="RUN",
                      help="a stored run's settings (-c and --set on top: what --like RUN starts a run with)")
    show.add_argument("--store", help="the store --run reads (default: the config's store, ./bcdflow-store)")
    show.set_defaults(fn=cmd_config_show)


def described(cfg) -> dict[str, dict]:
    """key -> {"value", "default", "meaning"} for every key of ``cfg`` (a ``RunConfig``), in the config's order."""
    from bcdflow.core.config import RunConfig, config_keys

    dumped, defaults = cfg.model_dump(mode="json"), RunConfig().model_dump(mode="json")
    out = {}
    for key in config_keys():
        sec, _, name = key.rpartition(".")
        field = (RunConfig.model_fields[sec].annotation.model_fields[name] if sec else RunConfig.model_fields[name])
        value, default = (dumped[sec][name], defaults[sec][name]) if sec else (dumped[name], defaults[name])
        out[key] = {"value": value, "default": default, "meaning": " ".join((field.description or "").split())}
    return out


def _scalar(v) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def as_yaml(keys: dict[str, dict]) -> str:
    """The keys as a YAML config file, sections as mappings, each meaning as the line's comment."""
    lines, section = [], None
    for key, k in keys.items():
        sec, _, name = key.rpartition(".")
        if sec and sec != section:
            lines.append(f"{sec}:")
        section = sec
        indent = "  " if sec else ""
        mark = "(set) " if k["value"] != k["default"] else ""
        lines.append(f"{indent}{name}: {_scalar(k['value'])}".ljust(40) + f"  # {mark}{k['meaning']}")
    return "\n".join(lines)


def cmd_config_show(args) -> int:
    from bcdflow.flows.like import like_config

    sets = [*(args.set or []), *([f"store={args.store}"] if args.store else [])]
    keys = described(like_config(args.config, sets, args.like))
    if args.json:
        print(strict_json(keys))
    else:
        print(f"# run {args.like}'s settings (store {keys['store']['value']})\n" if args.like else "", end="")
        print(as_yaml(keys))
    return 0
