"""The package's surface: every public name is documented, the extension's stubs name every function
it has (and no other), and docs/python.md mentions every public name."""

import inspect
import os
import re

import megatrain as mt
from megatrain import _megatrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_public_name_has_a_docstring():
    missing = []
    for name in mt.__all__:
        obj = getattr(mt, name)
        if name.startswith("__"):
            continue
        if not (getattr(obj, "__doc__", None) or "").strip():
            missing.append(name)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or not callable(member):
                    continue
                if not (member.__doc__ or "").strip():
                    missing.append(f"{name}.{attr}")
    assert not missing, f"no docstring: {missing}"


def test_the_extension_stubs_match_the_module():
    with open(os.path.join(os.path.dirname(mt.__file__), "_megatrain.pyi"), encoding="utf-8") as f:
        stubbed = set(re.findall(r"^def (\w+)\(", f.read(), re.M))
    defined = {n for n, v in vars(_megatrain).items() if callable(v) and not n.startswith("_") and n != "StatusError"}
    assert stubbed == defined


def test_docs_name_every_public_name():
    with open(os.path.join(ROOT, "docs", "python.md"), encoding="utf-8") as f:
        text = f.read()
    for name in mt.__all__:
        if not name.startswith("__"):
            assert re.search(rf"\b{name}\b", text), f"docs/python.md does not mention {name}"
