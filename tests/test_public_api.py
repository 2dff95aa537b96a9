"""Every public name imports and is documented."""

import inspect

import gna_lens


def test_every_public_name_imports_and_has_a_docstring():
    assert 15 <= len(gna_lens.__all__) <= 30
    for name in gna_lens.__all__:
        obj = getattr(gna_lens, name)
        if name != "__version__":
            assert inspect.getdoc(obj), name
