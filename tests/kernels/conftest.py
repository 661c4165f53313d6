import pytest

from cpumoe import ops


@pytest.fixture(autouse=True)
def output_guards():
    """Every kernel test runs with guard bytes around the ops' outputs, checked by each op before it returns
    (csrc/torch/output_guards.h): a kernel that writes outside its output fails the test that ran it."""
    ops._C.set_output_guards(True)
    yield
    ops._C.set_output_guards(False)
