"""tests/numerics_log.py records how much of a bound each comparison uses, and what went over."""

import pytest
import torch

from tests import numerics_log


def test_comparisons_are_recorded_with_the_share_of_their_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.testing, "assert_close", torch.testing.assert_close)
    approx_scalar = type(pytest.approx(0.0))  # its __eq__ is wrapped by install, put back after
    monkeypatch.setattr(approx_scalar, "__eq__", approx_scalar.__eq__)
    log = tmp_path / "log.jsonl"
    numerics_log.install(str(log))
    got, want = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 2**-9])  # exact in fp32
    torch.testing.assert_close(got, want, rtol=2e-3, atol=0, msg="case a, rank 1")
    with pytest.raises(AssertionError):  # a check that a bound catches a planted difference
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0, msg="case a, rank 1")
    assert 4.0 == pytest.approx(4.001, rel=1e-3)
    (key_close, close), (key_approx, approx) = sorted(
        numerics_log.summarize([str(log)]).items(), key=lambda kv: kv[0][1], reverse=True
    )
    assert key_close[1] == "case a"  # the rank is dropped: one row per comparison
    [close], [approx] = close.values(), approx.values()
    rel = 2**-9 / (2.0 + 2**-9)
    assert close["rel"] == pytest.approx(rel) and close["used"] == pytest.approx(rel / 2e-3)
    assert close["over_rel"] == pytest.approx(rel) and close["rtol"] == 2e-3
    assert approx["used"] == pytest.approx(0.001 / (1e-3 * 4.001))
