"""scripts/residual_peak.py, the account of what each residual mode holds at its peak that
docs/benchmark.md reads: its profiler-derived peak equals the counting allocator's to the byte, and
the activations it says autograd saved are the ones each mode keeps."""
import os
import runpy

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "residual_peak.py")


@pytest.fixture(scope="module")
def tiny():
    if not os.path.exists(SCRIPT):
        pytest.skip("scripts/ is not beside these tests")
    main = runpy.run_path(SCRIPT, run_name="residual_peak_under_test")["main"]
    return main(["--preset", "tiny", "--modes", "plain,checkpoint,fused"])


def test_profiled_peak_is_the_meters_to_the_byte(tiny):
    for mode, r in tiny.items():
        assert r["peak"] > 0, mode
        assert r["profiled_peak"] == r["peak"], mode
        # what is listed as alive at the peak is the peak
        assert sum(nbytes for nbytes, _, _ in r["alive"]) == r["peak"], mode


def test_saved_activations_are_what_each_mode_keeps(tiny):
    # tiny: batch 16, hidden 64, depth 3; an activation is 16 x 64 float32
    act = 16 * 64 * 4
    assert tiny["plain"]["saved"] == [(16, 64)] * 6  # each block's input and tanh output
    assert tiny["fused"]["saved"] == [(16, 64)] * 3  # each block's input only
    assert tiny["fused"]["kept"] == 3 * act
    assert tiny["plain"]["kept"] == 6 * act


def test_fused_peaks_an_activation_below_eager_checkpoint():
    # small: batch 2048, hidden 64. Fused keeps each block's input only and, without
    # retain_graph, lets the last block's input go before it allocates that block's input
    # gradient (as compiled checkpoint's backward does); eager checkpoint holds it there.
    if not os.path.exists(SCRIPT):
        pytest.skip("scripts/ is not beside these tests")
    main = runpy.run_path(SCRIPT, run_name="residual_peak_under_test")["main"]
    r = main(["--preset", "small", "--modes", "checkpoint,fused"])
    assert r["checkpoint"]["peak"] - r["fused"]["peak"] >= 2048 * 64 * 4
