"""``key.path=value`` overrides of a build config (``make build OVERRIDES=...``), applied to the parsed
YAML before the typed config is built from it: an unknown key is refused naming the closest one."""
from __future__ import annotations

import difflib
import json

import yaml

from builder.schema import ConfigError, all_key_paths


def _section_paths(config_cls: type) -> set[str]:
    """Key paths that name a whole (sub)section, which an override may replace as a mapping."""
    leaves = all_key_paths(config_cls)
    return {".".join(p.split(".")[:i]) for p in leaves for i in range(1, p.count(".") + 1)}


def apply_overrides(config_cls: type, data: dict, overrides: tuple[str, ...] | list[str], file: str) -> dict:
    """Return a copy of ``data`` with ``key.path=value`` overrides applied (values parsed as YAML);
    ``config_cls`` (BuildConfig) says which key paths exist."""
    data = json.loads(json.dumps(data, default=str))  # deep copy; YAML here is plain data
    leaves = all_key_paths(config_cls)
    sections = _section_paths(config_cls)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(file, item, "override must look like key.path=value",
                              "e.g. engine.max_batch_size=64")
        if key not in leaves and key not in sections:
            close = difflib.get_close_matches(key, leaves, n=1, cutoff=0.6)
            problem = f"unknown key in override '{item}'" + (f"; did you mean '{close[0]}'?" if close else "")
            raise ConfigError(file, key, problem, "any key of docs/contracts.md section 1, e.g. "
                              "quantization.format")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            raise ConfigError(file, key, f"override value {raw!r} is not valid YAML") from None
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return data
