"""Native <-> Hugging Face names for Laneformer.

Kog's released checkpoints keep the TorchTitan names under a ``model.``
prefix (spec section 4), with ``lm_head.weight`` at the top level, and the
lane-batched weights keep their ``[L, out, in]`` shapes. So the mapping is a
rename, never a reshape.
"""

from typing import Any

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

HF_PREFIX = "model."
TOP_LEVEL = ("lm_head.weight",)


def native_to_hf_name(name: str) -> str:
    return name if name in TOP_LEVEL else HF_PREFIX + name


def hf_to_native_name(name: str) -> str:
    if name in TOP_LEVEL:
        return name
    if not name.startswith(HF_PREFIX):
        raise KeyError(f"unexpected tensor {name!r}: Laneformer HF names start with {HF_PREFIX!r}")
    return name[len(HF_PREFIX):]


class LaneformerStateDictAdapter(StateDictAdapter):
    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {native_to_hf_name(k): v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {hf_to_native_name(k): v for k, v in hf_state_dict.items()}
