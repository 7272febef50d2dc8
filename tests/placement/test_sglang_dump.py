"""SGLang's expert distribution dumps read safely (placement/sglang_dump.py): a pickle with code
in it refused and never run, anything but a stat dump refused with the reason."""

import os
import pickle

import pytest
import torch

from nemo_moe_metrics.placement.sglang_dump import SglangDumpError, read_sglang_dump


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_with_code_in_it_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    payload = _Payload()
    payload.marker = marker
    dump = tmp_path / "evil.pt"
    with dump.open("wb") as f:
        pickle.dump({"logical_count": payload}, f, protocol=2)
    with pytest.raises(SglangDumpError, match="global posix.system") as refused:
        read_sglang_dump(dump)
    assert "weights_only=False" not in str(refused.value)
    assert not marker.exists()
    # The same file under a plain unpickler does run its code (so the refusal mattered).
    with dump.open("rb") as f:
        pickle.load(f)  # noqa: S301
    assert marker.exists()


@pytest.mark.parametrize(
    "data,why",
    [
        ({"records": [], "last_physical_to_logical_map": torch.zeros(2, 2)}, "per_token"),
        ({"logical_count": torch.zeros(3, 4)}, r"\[passes, layers, experts\]"),
        ({"logical_count": torch.zeros(1, 3, 4)}, "integer"),
        ({"other": 1}, "logical_count"),
        (torch.zeros(3), "not a dict"),
    ],
)
def test_anything_but_a_stat_dump_is_refused_with_the_reason(tmp_path, data, why):
    dump = tmp_path / "d.pt"
    torch.save(data, dump)
    with pytest.raises(SglangDumpError, match=why):
        read_sglang_dump(dump)
