"""Every public name imports and is documented."""

import inspect

import gna_lens


def test_every_public_name_imports_and_has_a_docstring():
    assert 15 <= len(gna_lens.__all__) <= 30
    for name in gna_lens.__all__:
        obj = getattr(gna_lens, name)
        if name != "__version__":
            assert inspect.getdoc(obj), name


def test_public_submodules_are_attributes_loaded_lazily():
    """``gna_lens.zoo`` works like ``gna_lens.tasks``, without importing zoo at ``import gna_lens``."""
    import subprocess
    import sys

    lazy = ["findings", "hybrid", "plots", "scan", "testing", "zoo"]
    code = (
        "import sys, gna_lens\n"
        f"lazy = {lazy!r}\n"
        "assert not [m for m in lazy if 'gna_lens.' + m in sys.modules], 'imported eagerly'\n"
        "for m in lazy + ['tasks', 'interventions', 'scoring', 'models', 'stats', 'heads', 'runtime']:\n"
        "    mod = getattr(gna_lens, m)\n"
        "    assert mod is sys.modules['gna_lens.' + m], m\n"
        "    assert m in dir(gna_lens), m\n"
        "from gna_lens import zoo\n"
        "assert zoo is gna_lens.zoo\n"
        "try:\n"
        "    gna_lens.not_a_submodule\n"
        "except AttributeError as err:\n"
        "    assert 'not_a_submodule' in str(err) and 'zoo' in str(err), err\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
