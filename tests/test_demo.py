"""The README's main job runs offline and learns."""

from train import demo


def test_demo_trains_and_generates(capsys):
    result = demo.main(["--steps", "25", "--batch", "4", "--seq-len", "64"])
    losses = result["losses"]
    assert len(losses) == 25 and losses[-1] < losses[0] - 1.0, losses
    assert result["generation"].startswith(b"A query reads both")
    assert len(result["generation"]) == len(b"A query reads both") + 80
    assert "step 25/25" in capsys.readouterr().out
