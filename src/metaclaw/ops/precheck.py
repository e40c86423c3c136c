"""Start-time checks of `metaclaw train|serve` overrides, before Hydra runs and before any model loads.

Each mistake ends the command with one line that names the fix, instead of Hydra's advice to
append a mistyped key with `+` or a traceback minutes later (exit status 1):

- a mistyped key (`data.batch_sise=4`): the close matches among the config's keys;
- an unknown option of a group (`model=qwen3_8bb`): the close match and the options;
- a wrong type (`data.batch_size=four`): the field, what it accepts (`metaclaw.ops.schema`);
- a busy port (`rollout.proxy.port`, `serve.port`): which one, and the override that moves it.
"""

from __future__ import annotations

import difflib
import errno
import socket
from collections.abc import Iterator, Sequence
from typing import Any

from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, TypeAdapter, ValidationError

from metaclaw.ops.schema import SCHEMAS

_MISSING = object()


class StartError(SystemExit):
    """A mistake on the command line: its one line on stderr, exit status 1."""

    def __init__(self, message: str) -> None:
        super().__init__(f"metaclaw: {message}")


def check_command_line(config_name: str, args: Sequence[str], groups: dict[str, list[str]]) -> None:
    """Raise `StartError` for the first mistake in `args` (Hydra overrides of `config_name`); None when fine."""
    parsed = _parse(args)
    if parsed is None:
        return  # Hydra's own options (--cfg, -m, --help, ...): Hydra handles that command line
    choices = [o for o in parsed if o.key_or_group in groups and not o.is_add() and not o.is_delete()]
    for o in choices:
        value = o.value()
        options = groups[o.key_or_group]
        if isinstance(value, str) and value not in options:
            near = difflib.get_close_matches(value, options, n=1)
            hint = f"did you mean {o.key_or_group}={near[0]}? " if near else ""
            raise StartError(f"unknown {o.key_or_group} {value!r}: {hint}(options: {', '.join(options)})")
    cfg = _compose(config_name, [o.input_line for o in choices])
    plain = [o for o in parsed if o not in choices and not (o.is_add() or o.is_force_add() or o.is_delete())]
    for o in plain:
        key = o.key_or_group
        if key.startswith("hydra") or "/" in key or _exists(cfg, key):
            continue
        near = difflib.get_close_matches(key, list(_keys(cfg)), n=3, cutoff=0.75)
        hint = f"did you mean {' or '.join(near)}? " if near else ""
        raise StartError(f"unknown setting {key!r}: {hint}(`metaclaw {config_name} --cfg job` lists every setting; "
                         f"a new key needs a leading +)")  # fmt: skip
    cfg = _compose(config_name, [o.input_line for o in parsed])
    check_types(cfg, SCHEMAS[config_name])
    check_ports(cfg, config_name)


def _parse(args: Sequence[str]) -> list[Any] | None:
    if any(a.startswith("-") for a in args):
        return None
    try:
        return OverridesParser.create().parse_overrides(list(args))
    except HydraException as e:
        raise StartError(f"cannot read the override: {str(e).splitlines()[0]}") from None


def _compose(config_name: str, overrides: list[str]) -> DictConfig:
    try:
        with initialize_config_module("metaclaw.conf", version_base="1.3"):  # restores Hydra's state on exit
            return compose(config_name, overrides=overrides)
    except HydraException as e:
        raise StartError(str(e).splitlines()[0]) from None


def _exists(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_resolution_failure=False) if parent else cfg
    return isinstance(node, DictConfig) and leaf in node


def _keys(node: Any, prefix: str = "") -> Iterator[str]:
    """Every dotted key of `node` (values are not resolved)."""
    if not isinstance(node, DictConfig):
        return
    for key in node:
        path = f"{prefix}{key!s}"
        yield path
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_interpolation():
            yield from _keys(child, f"{path}.")


def check_types(cfg: DictConfig, schema: type[BaseModel], prefix: str = "") -> None:
    """Each field of `schema` that `cfg` holds (resolved where it can be) against its type."""
    for name, field in schema.model_fields.items():
        key = f"{prefix}{name}"
        value = OmegaConf.select(cfg, key, default=_MISSING, throw_on_resolution_failure=False)
        if value is _MISSING or value is None:
            continue
        kind = next((t for t in _types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if kind is not None:
            check_types(cfg, kind, f"{key}.")
            continue
        try:
            TypeAdapter(field.rebuild_annotation()).validate_python(value)  # with its constraints (ge, Literal...)
        except ValidationError as e:
            first = e.errors()[0]
            raise StartError(f"{key}={value!r}: {first['msg'].lower()}") from None


def _types(annotation: Any) -> tuple[Any, ...]:
    return (annotation, *getattr(annotation, "__args__", ()))


def check_ports(cfg: DictConfig, config_name: str) -> None:
    """The ports this command binds, free now (before the model loads, not after)."""
    wanted = []
    if config_name == "serve":  # the training server listens on app.port (METACLAW_PORT or serve.port)
        app = "app" if OmegaConf.select(cfg, "app.port", default=None) is not None else "serve"
        name = str(OmegaConf.select(cfg, "app.name", default="training_server")).replace("_", " ")
        wanted.append((f"the {name}", f"{app}.host", f"{app}.port"))
    if config_name == "train" and OmegaConf.select(cfg, "rollout.proxy", default=None) is not None:
        wanted.append(("the rollout proxy", "rollout.proxy.host", "rollout.proxy.port"))
    for what, host_key, port_key in wanted:
        host, port = OmegaConf.select(cfg, host_key), OmegaConf.select(cfg, port_key)
        port = int(port) if isinstance(port, str) and port.isdigit() else port  # oc.env gives a string
        if isinstance(port, int) and port > 0 and isinstance(host, str):
            busy = port_in_use(host, port)
            if busy:
                raise StartError(f"port {port} on {host} ({what}) is {busy}: stop what listens there "
                                 f"(`ss -ltnp 'sport = :{port}'`) or pick another with {port_key}=N "
                                 f"(0: a free one)")  # fmt: skip


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound now ("in use", ...), or None when it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as e:
            return "in use" if e.errno == errno.EADDRINUSE else f"not available ({e.strerror})"
    return None
