"""The suite runs with gna_lens's jaxtyping annotations checked on every call
(``tests/typecheck.py``, wired in ``pyproject.toml``): a tensor the annotation rules out fails."""

import jaxtyping
import pytest
import torch

from gna_lens.scoring.patterns import row_sharpness
from tests.typecheck import ShapeError


def _chain(err: BaseException) -> str:
    text = []
    while err is not None:
        text.append(str(err))
        err = err.__cause__ or err.__context__
    return "\n".join(text)


@pytest.mark.parametrize(
    "bad",
    [torch.tensor([[1, 3]]), torch.tensor(0.5)],  # integers; no k axis
    ids=["dtype", "rank"],
)
def test_a_tensor_against_its_annotation_fails_during_the_tests(bad):
    row_sharpness(torch.tensor([[0.25, 0.75]]))  # Float[Tensor, "... k"]: fine
    with pytest.raises((ShapeError, jaxtyping.TypeCheckError)) as err:
        row_sharpness(bad)
    assert "row_sharpness: argument 'weights'" in _chain(err.value)
