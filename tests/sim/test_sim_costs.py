"""The cost model: defaults, parsing, and clear errors for bad values."""

import pytest

from megapipe.schedule.ir import Kind
from megapipe.sim.costs import Costs


def test_defaults_and_derived_values():
    costs = Costs()
    assert (costs.forward, costs.backward, costs.weight, costs.input_grad) == (1, 2, 1, 1)
    assert not costs.has_comm
    assert costs.compute(Kind.I, 0) == 1
    scaled = Costs(2, 4, 1, stage_multipliers=(1.0, 1.5))
    assert scaled.compute(Kind.F, 1) == 3 and scaled.compute(Kind.I, 1) == 4.5


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(forward=-1), "forward must be a finite number >= 0"),
        (dict(backward=float("nan")), "backward must be a finite number >= 0"),
        (dict(backward=1, weight=2), r"weight \(W=2\) must not exceed backward \(B=1\)"),
        (dict(dispatch=-0.1), "dispatch must be a finite"),
        (dict(p2p_latency="1"), "p2p_latency must be a number"),
        (dict(stage_multipliers=(1, 0)), r"stage_multipliers\[1\] must be > 0"),
        (dict(moe_layers=-1), "moe_layers must be >= 0"),
        (dict(moe_layers=1.5), "moe_layers must be an integer"),
        (dict(attention_share=1.5), r"attention_share must lie in \[0, 1\]"),
    ],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Costs(**kwargs)


def test_from_text():
    assert Costs.from_text("1,2,1") == Costs(1, 2, 1)
    with_a2a = Costs.from_text("1, 2, 0.5, 0.25", moe_layers=2)
    assert (with_a2a.dispatch, with_a2a.combine, with_a2a.moe_layers) == (0.25, 0.25, 2)
    assert with_a2a.has_comm
    for bad in ("1,2", "1,2,x", "1,2,3,4,5"):
        with pytest.raises(ValueError, match="F,B,W or F,B,W,A2A"):
            Costs.from_text(bad)
    with pytest.raises(ValueError, match="must not exceed backward"):
        Costs.from_text("1,2,3")
