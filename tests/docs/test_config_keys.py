"""Every config key is documented once: docs/contracts.md section 1 holds the whole schema as YAML
(the README points there), and this test keeps it the schema's."""
from __future__ import annotations

import re

import yaml

from builder.config import BuildConfig
from builder.schema import all_key_paths
from tests.docs.doc_checks import REPO


def _documented() -> tuple[set[str], str]:
    text = (REPO / "docs" / "contracts.md").read_text(encoding="utf-8")
    block = re.search(r"^## 1\. Config.*?```yaml\n(.*?)```", text, re.S | re.M).group(1)

    def leaves(d: dict, prefix: str = "") -> list[str]:
        out = []
        for k, v in d.items():
            path = f"{prefix}.{k}" if prefix else k
            out += leaves(v, path) if isinstance(v, dict) else [path]
        return out
    return set(leaves(yaml.safe_load(block))), block


def test_the_contracts_page_documents_every_config_key_and_no_other():
    documented, block = _documented()
    keys = set(all_key_paths(BuildConfig))
    # a key kept only to refuse it with a pointer to its replacement is documented as a comment
    removed = {k for k in keys - documented if re.search(rf"#\s*{re.escape(k.rsplit('.', 1)[1])}: removed", block)}
    assert keys - documented - removed == set(), "config keys missing from docs/contracts.md section 1"
    assert documented - keys == set(), "docs/contracts.md section 1 documents keys the schema does not have"


def test_the_documented_defaults_are_the_schemas():
    """Where the page gives a plain value, it is the default BuildConfig() holds."""
    documented, block = _documented()
    data = yaml.safe_load(block)
    defaults = BuildConfig().to_dict()
    wrong = []
    for path in documented:
        doc, code = data, defaults
        for part in path.split("."):
            doc, code = doc[part], code.get(part) if isinstance(code, dict) else None
        if doc != code:
            wrong.append(f"{path}: page says {doc!r}, schema default {code!r}")
    assert not wrong, "\n".join(wrong)
