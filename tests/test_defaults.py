"""One source per default: a setting beside a `_target_` is never the code's default written a second time.

The rule, for every node with a `_target_` (each option of each config group composed as tests/test_configs.py
composes it, and every YAML file under `conf/` read on its own), for every setting beside it (a mapping argument
whose default is a mapping or dataclass is followed key by key):

1. A literal never equals the target's own default (its signature's, a dataclass field's factory): a value written
   twice drifts (`ScoringWorker.at_least_one` said `True` in code, `false` in YAML, "off by default" in its
   docstring). To show a setting without restating it, write `${metaclaw_default:}` (`metaclaw.config.code_default`);
   an interpolation that wires another node (`${model.name}`) is no literal.
2. The file that writes a metaclaw `_target_` (the node's owner) writes a literal only for an argument without a
   default (a model's name and path). Every default of metaclaw's own code lives in that code, so the value the
   product runs with is the code's. A value that differs from it is written by another file: a group option or an
   experiment that changes a setting for its own purpose (rollout=simulated_user's short `session_idle_s`,
   app=training_server's Tinker `sum`), and rule 1 makes it a real change. For a target outside metaclaw (torch's
   AdamW, Lightning's loggers) the value we choose is written in the YAML, the one place it is ours.

Settings a target does not take (read by another part: tests/test_configs.py's `READ_ELSEWHERE`) are outside the rule.
No allow-list: a failure names the file or option, the path, the value and the code default.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig, Node, OmegaConf

from metaclaw.config import CONFIG_DIR, NoDefault, code_default, register_resolvers
from tests.test_configs import _compose, _options, targets

register_resolvers()


def _literal(node: Node) -> bool:
    """A value written out in YAML: no interpolation anywhere in it, and no `_target_` of its own."""
    if node._is_interpolation():
        return False
    if isinstance(node, DictConfig):
        return node._is_none() or ("_target_" not in node and all(_literal(node._get_node(k)) for k in node))
    if isinstance(node, ListConfig):
        return node._is_none() or all(_literal(node._get_node(i)) for i in range(len(node)))
    return True


def _same(value, default) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    return value == default


def literal_settings(node: DictConfig) -> Iterator[tuple[list[str], object, object]]:
    """(path below the target, literal value, code default) of every literal setting with a code default."""

    def walk(sub: DictConfig, path: list[str]) -> Iterator[tuple[list[str], object, object]]:
        for key in sub:
            key = str(key)
            if not path and key.startswith("_"):
                continue
            child = sub._get_node(key)
            if isinstance(child, DictConfig) and "_target_" in child:
                continue  # a node of its own
            try:
                default = code_default(str(node._target_), [*path, key])
            except NoDefault:
                continue  # required, or not an argument of the target (tests/test_configs.py checks those)
            if isinstance(child, DictConfig) and not child._is_none() and isinstance(default, dict):
                yield from walk(child, [*path, key])
            elif _literal(child):
                value = OmegaConf.to_container(child) if isinstance(child, DictConfig | ListConfig) else child._value()
                yield [*path, key], value, default

    yield from walk(node, [])


def _yaml_files() -> list[Path]:
    return sorted(CONFIG_DIR.rglob("*.yaml"))


@pytest.mark.parametrize(("config_name", "group", "option"), list(_options()))
def test_no_literal_repeats_the_code_default(config_name, group, option, tmp_path):
    """Rule 1, on the composed config of each group option (so an override file that restates a default fails)."""
    flag = f"+experiment={option}" if group == "experiment" else f"{group}={option}"
    cfg = _compose(config_name, [flag], tmp_path)
    repeats = [
        f"{path}.{'.'.join(keys)} = {value!r} ({node._target_}'s default)"
        for path, node in targets(cfg)
        for keys, value, default in literal_settings(node)
        if _same(value, default)
    ]
    assert not repeats, f"{flag}: literals that repeat the code default (write ${{metaclaw_default:}}): {repeats}"


@pytest.mark.parametrize("file", _yaml_files(), ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_a_file_that_names_a_metaclaw_target_writes_no_default(file):
    """Rule 2, on each YAML file as written: the owner of a metaclaw `_target_` leaves every default to the code."""
    raw = OmegaConf.load(file)
    written = [
        f"{path}.{'.'.join(keys)} = {value!r} (code: {default!r})"
        for path, node in targets(raw)
        if str(node._target_).startswith("metaclaw.")
        for keys, value, default in literal_settings(node)
    ]
    assert not written, f"{file.relative_to(CONFIG_DIR)} writes defaults its metaclaw target owns: {written}"


def test_the_resolver_reads_the_code_and_overrides_still_apply(tmp_path):
    """`${metaclaw_default:}` is the code's value, nested keys included; a command-line override replaces it."""
    cfg = _compose("train", ["rollout=proxy"], tmp_path)
    text = (CONFIG_DIR / "scoring" / "default.yaml").read_text()
    assert "session_idle_s: ${metaclaw_default:}" in text
    assert cfg.rollout.scoring.session_idle_s == code_default(cfg.rollout.scoring._target_, ["session_idle_s"])
    assert cfg.rollout.proxy.images.mode == code_default(cfg.rollout.proxy._target_, ["images", "mode"])
    changed = _compose("train", ["rollout=proxy", "rollout.scoring.session_idle_s=12", "privacy.pii.email=keep"],
                       tmp_path)  # fmt: skip
    assert changed.rollout.scoring.session_idle_s == 12 and changed.privacy.pii.email == "keep"
    for node in (cfg.optimizer, cfg.rollout.proxy, cfg.model, cfg.privacy):
        OmegaConf.resolve(node)  # as Hydra's instantiate resolves: list and mapping defaults become nodes
    assert cfg.optimizer.betas == [0.9, 0.999] and cfg.rollout.proxy.allowed_hosts == []
    assert cfg.model.thinking.template_kwargs == {} and cfg.privacy.trusted_outbound == []
