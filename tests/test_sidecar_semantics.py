"""The sidecar's semantic fields are read, never guessed: `shift`, `clean_causal` and
`within_block_causal` must be present and boolean, and the engine refuses what it cannot decode."""

import json
import re

import pytest

from bdcore.loading import load_checkpoint
from bdcore.serving_gate import CannotServe
from bdcore.sidecar import SIDECAR_NAME, SidecarError, read_sidecar
from tests.tiny import tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _with_sidecar(ckpt, tmp_path, **change):
    """A copy of the checkpoint whose sidecar has `change` applied (a value of None deletes the key)."""
    import shutil

    out = tmp_path / "changed"
    shutil.copytree(ckpt, out)
    data = json.loads((out / SIDECAR_NAME).read_text())
    for key, value in change.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    (out / SIDECAR_NAME).write_text(json.dumps(data))
    return out


@pytest.mark.parametrize("field", ["clean_causal", "shift", "within_block_causal", "bd_size", "mask_id"])
def test_a_missing_semantic_field_is_refused_not_defaulted(ckpt, tmp_path, field):
    changed = _with_sidecar(ckpt, tmp_path, **{field: None})
    with pytest.raises(SidecarError, match=f"missing required field.*{field}"):
        read_sidecar(changed)
    with pytest.raises(SidecarError, match=field):
        load_checkpoint(changed)


@pytest.mark.parametrize("field", ["clean_causal", "shift", "within_block_causal"])
def test_flags_must_be_booleans(ckpt, tmp_path, field):
    with pytest.raises(SidecarError, match=f"{field} must be true or false"):
        read_sidecar(_with_sidecar(ckpt, tmp_path, **{field: "false"}))


def test_unshifted_checkpoint_with_a_causal_clean_stream_is_refused_by_the_engine(ckpt, tmp_path):
    """Unshifted (single-stream) checkpoints see their blocks both ways: shift false + clean_causal true
    matches no training run, so the engine refuses it rather than guess (a real one serves: see
    tests/test_single_stream.py)."""
    changed = _with_sidecar(ckpt, tmp_path, shift=False)
    assert read_sidecar(changed).shift is False  # the field is read as written
    with pytest.raises(CannotServe, match="shift: false with clean_causal: true"):
        load_checkpoint(changed)


def test_serve_cli_refuses_an_impossible_unshifted_checkpoint_in_one_line(ckpt, tmp_path):
    from inference import serve

    changed = _with_sidecar(ckpt, tmp_path, shift=False)
    with pytest.raises(SystemExit, match="shift: false"):
        serve.main([str(changed), "--mode", "diffusion", "--backend", "native"])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ar_loss_weight", "lots"),
        ("ar_loss_weight", -0.5),
        ("ar_loss_weight", float("nan")),
        ("views", 0),
        ("views", 1.5),
        ("bd_size", True),
        ("bd_size", "32"),
        ("mask_id", -1),
        ("mask_token", 3),
        ("mask_token", ""),
        ("base_model", 7),
        ("global_step", -1),
        ("global_step", "2000"),
        ("draft_adapter", "../elsewhere"),
    ],
)
def test_every_field_of_the_wrong_type_or_range_is_refused_by_name(ckpt, tmp_path, field, value):
    """`"ar_loss_weight": "lots"` and `"views": 0` used to be read silently."""
    changed = _with_sidecar(ckpt, tmp_path, **{field: value})
    with pytest.raises(SidecarError, match=f"{field} must be .*, got {re.escape(repr(value))}"):
        read_sidecar(changed)
    with pytest.raises(SidecarError, match=f"{field} must be"):
        load_checkpoint(changed)
