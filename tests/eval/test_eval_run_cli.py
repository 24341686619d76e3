"""eval.run's command line: bad input exits 2 with the reason, before any model is loaded."""

import pytest

from eval.run import main


@pytest.mark.parametrize("sets, message", [
    (["no_such_field=1"], "'no_such_field' is not a Laneformer.Config field"),
    (["delay"], "--set 'delay': expected key=value"),
])
def test_a_bad_set_exits_2_naming_it(tmp_path, capsys, sets, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint", str(tmp_path), *(f"--set={s}" for s in sets)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_folder_that_holds_no_checkpoint_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--checkpoint", str(tmp_path)])
    assert exit_.value.code == 2
    assert f"{tmp_path}: neither a DCP checkpoint" in capsys.readouterr().err
